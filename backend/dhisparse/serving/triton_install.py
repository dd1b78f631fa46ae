"""Where the real Triton Inference Server lives, and the backend directory it needs.

The server is the `tritonserver` 2.51 binary shipped inside the `nvidia-pytriton==0.7.0` wheel, together
with the Python backend (`libtriton_python.so`, `triton_python_backend_utils.py`, one stub per Python
version) and the shared libraries it links against (`site-packages/nvidia_pytriton.libs`). Triton
expects a backend directory laid out as `<dir>/python/{libtriton_python.so, triton_python_backend_utils.py,
triton_python_backend_stub}`; `prepare_backend_dir` assembles one from those files.

That bundled server is the development default. In production, run the operator's own Triton (an NGC
`tritonserver` container's `/opt/tritonserver`: `bin/tritonserver`, `lib/`, `backends/python/` with the stub of the
container's Python): `TritonInstall.from_root(root)` (`dhisparse-serve --triton-root /opt/tritonserver`) uses its
server, libraries and backend directory as they are. The tests run that same path over an NGC-shaped directory
made from the bundled files (`make_root`).
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB = "triton_python_backend_stub"


class TritonNotInstalledError(RuntimeError):
    """Raised when the pytriton wheel (and with it tritonserver) is missing or incomplete."""


@dataclass(frozen=True)
class TritonInstall:
    """Paths of one tritonserver installation (all absolute).

    Attributes:
        server_binary: the `tritonserver` executable.
        library_dir: directory to put on `LD_LIBRARY_PATH` (the wheel's vendored shared libraries).
        python_backend_dir: directory holding `libtriton_python.so` and `triton_python_backend_utils.py`.
        stub: the Python backend stub built for the running interpreter's Python version.
        backend_dir: a ready backend directory to pass as `--backend-directory` as is (an operator's installation),
            or None: `prepare_backend_dir` assembles one (the bundled wheel).
    """

    server_binary: Path
    library_dir: Path
    python_backend_dir: Path
    stub: Path
    backend_dir: Path | None = None

    @classmethod
    def from_root(cls, root: str | Path) -> TritonInstall:
        """An installation laid out as an NGC container's `/opt/tritonserver` (see the module docstring)."""
        root = Path(root).resolve()
        install = cls(server_binary=root / "bin" / "tritonserver", library_dir=root / "lib",
                      python_backend_dir=root / "backends" / "python",
                      stub=root / "backends" / "python" / _STUB, backend_dir=root / "backends")
        install.check()
        stub_python = install.stub_python_version()
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if stub_python and stub_python != here:
            raise TritonNotInstalledError(
                f"{install.stub} runs Python {stub_python} but dhisparse-serve runs {here}: install adaptive-dhisparse "
                f"into the Python {stub_python} environment of that Triton and run dhisparse-serve from there")
        return install

    def stub_python_version(self) -> str:
        """The `X.Y` of the libpython the stub links against ("" when it cannot be read)."""
        try:
            found = re.search(rb"libpython(3\.\d+)", self.stub.read_bytes())
        except OSError:
            return ""
        return found.group(1).decode() if found else ""

    @classmethod
    def locate(cls) -> TritonInstall:
        """Find the installation shipped by `nvidia-pytriton` in the running interpreter's environment."""
        try:
            import pytriton  # optional dependency, only needed to serve
        except ImportError as error:
            raise TritonNotInstalledError(
                "nvidia-pytriton is not installed; run scripts/setup_triton.sh (or pip install "
                "'adaptive-dhisparse[serve]')"
            ) from error
        package_dir = Path(pytriton.__file__).resolve().parent
        root = package_dir / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        install = cls(
            server_binary=root / "bin" / "tritonserver",
            library_dir=package_dir.parent / "nvidia_pytriton.libs",
            python_backend_dir=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / _STUB,
        )
        install.check()
        return install

    def check(self) -> None:
        """Raise `TritonNotInstalledError` naming the first missing file."""
        required = [self.server_binary, self.library_dir, self.stub]
        required += [self.python_backend_dir / name for name in _BACKEND_FILES]
        for path in required:
            if not path.exists():
                raise TritonNotInstalledError(f"incomplete Triton installation: {path} is missing")


def prepare_backend_dir(install: TritonInstall, destination: Path) -> Path:
    """Assemble the Python backend under `destination/python/` and return `destination` (an installation with its
    own backend directory: that directory, untouched).

    Copies (not links: Triton resolves the stub next to the backend library) the backend library,
    its utility module and the stub for this interpreter. Idempotent: existing files are replaced.
    """
    if install.backend_dir is not None:
        return install.backend_dir
    python_dir = destination / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in _BACKEND_FILES:
        shutil.copy2(install.python_backend_dir / name, python_dir / name)
    shutil.copy2(install.stub, python_dir / _STUB)
    (python_dir / _STUB).chmod(0o755)
    return destination


def make_root(install: TritonInstall, root: Path) -> Path:
    """Lay out ``install`` (the bundled one) as an NGC `/opt/tritonserver` under ``root`` (links for the server and
    libraries, the Python backend assembled in `backends/python/`); for `from_root` on machines without NGC."""
    (root / "bin").mkdir(parents=True, exist_ok=True)
    for link, target in ((root / "bin" / "tritonserver", install.server_binary), (root / "lib", install.library_dir)):
        if not link.exists():
            link.symlink_to(target)
    prepare_backend_dir(TritonInstall(install.server_binary, install.library_dir, install.python_backend_dir,
                                      install.stub), root / "backends")
    return root
