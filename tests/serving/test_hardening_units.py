"""The hardening pieces on their own (no server): tritonserver's security flags, request limits, internal tokens,
the repository claim, the drain watch, incremental stop sequences and the CLI flags that build them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.serving import cli_hardening
from dhisparse.serving.cli import parse_args
from dhisparse.serving.drain import DrainWatch
from dhisparse.serving.internal_auth import (
    AUTH_INPUT,
    CANCEL,
    InternalAuth,
    UnauthorizedError,
    read_key_file,
    write_key_file,
)
from dhisparse.serving.limits import LimitExceededError, RequestLimits
from dhisparse.serving.repository import claim_repository
from dhisparse.serving.stop_sequences import StopSequenceMatcher
from dhisparse.serving.triton_security import ADMIN_HEADER, GrpcTls, SecurityOptions


def test_admin_apis_are_restricted_by_default_with_a_key_nobody_knows() -> None:
    first, second = SecurityOptions().args(), SecurityOptions().args()
    http = [a for a in first if a.startswith("--http-restricted-api=")]
    grpc = [a for a in first if a.startswith("--grpc-restricted-protocol=")]
    assert len(http) == len(grpc) == 1
    apis, _, rest = http[0].split("=", 1)[1].partition(":")
    assert set(apis.split(",")) == {"model-repository", "shared-memory", "trace", "logging"}
    assert rest.startswith(f"{ADMIN_HEADER}=") and len(rest) > len(ADMIN_HEADER) + 30
    assert first != second  # a fresh random key per start
    chosen = SecurityOptions(admin_key="k" * 20).args()
    assert f"--http-restricted-api=model-repository,shared-memory,trace,logging:{ADMIN_HEADER}={'k' * 20}" in chosen
    assert "--allow-http=false" in SecurityOptions(allow_http=False).args()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"admin_key": "short"}, "admin_key"),
    ({"admin_apis": ("everything",)}, "unknown API"),
    ({"restrictions": ("inference:x-key=v", "inference:y=v")}, "restricted twice"),
    ({"restrictions": ("model-repository:x=v",)}, "restricted twice"),
    ({"restrictions": ("inference x=v",)}, "APIS:HEADER=VALUE"),
])
def test_bad_security_options_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SecurityOptions(**kwargs)


def test_grpc_tls_flags(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    assert GrpcTls(cert, key).args()[0] == "--grpc-use-ssl=true"
    assert GrpcTls(cert, key, cert, mutual=True).args()[0] == "--grpc-use-ssl-mutual=true"
    with pytest.raises(ValueError, match="root certificate"):
        GrpcTls(cert, key, mutual=True)
    with pytest.raises(ValueError, match="server_key"):
        GrpcTls(cert, tmp_path / "missing.pem")


def test_limits_round_trip_resolve_and_name_themselves() -> None:
    limits = RequestLimits(max_words=10).resolved(max_model_len=512, vocab_size=320, triton_max_batch_size=4)
    assert limits.max_prompt_tokens == 511 and limits.max_prompt_bytes == 32 * 511 and limits.max_batch == 4
    assert RequestLimits.from_parameters({**limits.parameters(), "unrelated": "1"}) == limits
    assert RequestLimits.parse_overrides(["max-words=3", "max_batch=2"]) == {"max_words": 3, "max_batch": 2}
    with pytest.raises(ValueError, match="NAME one of"):
        RequestLimits.parse_overrides(["max_everything=1"])
    with pytest.raises(ValueError, match="max_words must be >= 1"):
        RequestLimits(max_words=0)
    with pytest.raises(LimitExceededError, match=r"limit max_words = 10 \(dhisparse-serve --limit max_words=N\)"):
        limits.check_word_tokens("bad_words_list", [(1,)] * 11)
    with pytest.raises(LimitExceededError, match="limit max_request_bytes"):  # counted without walking the list
        RequestLimits(max_request_bytes=1000).check_request_bytes({"x": np.array([b""] * 300, dtype=object)})
    with pytest.raises(LimitExceededError, match="limit max_sequences"):
        RequestLimits(max_sequences=10).check_batch(2, 6)


def test_internal_tokens_are_single_use_bound_and_expire(tmp_path: Path) -> None:
    key_file = write_key_file(tmp_path / "k")
    assert key_file.stat().st_mode & 0o777 == 0o600
    auth = InternalAuth(read_key_file(key_file), max_age_s=60)
    token = auth.token(CANCEL, "req-1")
    with pytest.raises(UnauthorizedError, match="no valid"):
        auth.check({AUTH_INPUT: token}, CANCEL, "req-2", "refused")  # another subject
    with pytest.raises(UnauthorizedError, match="no valid"):
        auth.check({AUTH_INPUT: token}, "context", "req-1", "refused")  # another purpose
    auth.check({AUTH_INPUT: token}, CANCEL, "req-1", "refused")
    with pytest.raises(UnauthorizedError, match="already used"):
        auth.check({AUTH_INPUT: token}, CANCEL, "req-1", "refused")
    with pytest.raises(UnauthorizedError, match="no valid"):
        auth.check({AUTH_INPUT: auth.token(CANCEL, "req-1", now=time.time() - 600)}, CANCEL, "req-1", "refused")
    with pytest.raises(UnauthorizedError, match="no valid"):
        InternalAuth(bytes(32)).check({AUTH_INPUT: auth.token(CANCEL, "x")}, CANCEL, "x", "refused")
    with pytest.raises(UnauthorizedError):
        auth.check({}, CANCEL, "x", "refused")
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_key_file(key_file)


def test_model_repository_must_be_new_empty_or_ours(tmp_path: Path) -> None:
    claim_repository(tmp_path / "new", ["dhisparse"])
    (tmp_path / "empty").mkdir()
    claim_repository(tmp_path / "empty", ["dhisparse"])
    foreign = tmp_path / "foreign"
    (foreign / "model").mkdir(parents=True)
    with pytest.raises(ValueError, match="not written by dhisparse-serve"):
        claim_repository(foreign, ["dhisparse"])
    assert (foreign / "model").is_dir()
    ours = tmp_path / "ours"
    (ours / ".dhisparse").mkdir(parents=True)
    (ours / ".dhisparse" / "repository").write_text("")
    (ours / "dhisparse").mkdir()
    (ours / "stale").mkdir()
    (ours / "stray.txt").write_text("")
    claim_repository(ours, ["dhisparse"])
    assert sorted(p.name for p in ours.iterdir()) == [".dhisparse", "dhisparse"]


def test_drain_watch_sees_the_file_or_the_launchers_death(tmp_path: Path) -> None:
    watch = DrainWatch(tmp_path / "drain", 0, grace_s=0.2)
    watch.poll()
    assert not watch.draining
    (tmp_path / "drain").touch()
    watch.poll()
    assert watch.draining and not watch.expired and "shutting down" in str(watch.refusal())
    time.sleep(0.25)
    assert watch.expired and "grace 0.2 s" in str(watch.stopped())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a launcher pid that is gone
    orphaned = DrainWatch(None, pid, grace_s=1)
    orphaned.poll()
    assert orphaned.draining and "launcher is gone" in orphaned.reason
    alive = DrainWatch(None, os.getpid(), grace_s=1)
    alive.poll()
    assert not alive.draining


def _naive_stop(sequences: list[tuple[int, ...]], tokens: list[list[int]], min_tokens: int) -> tuple[int, int] | None:
    fed: list[int] = []
    for chunk, new in enumerate(tokens):
        for index, token in enumerate(new):
            fed.append(token)
            if len(fed) > min_tokens and any(tuple(fed[-len(s):]) == s for s in sequences if len(s) <= len(fed)):
                return chunk, index + 1
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple), min_size=1, max_size=6),
       st.lists(st.lists(st.integers(0, 4), max_size=5), max_size=6), st.integers(0, 3))
def test_incremental_stop_matching_equals_the_naive_scan(sequences, tokens, min_tokens) -> None:
    matcher = StopSequenceMatcher(sequences, min_tokens)
    got = None
    for chunk, new in enumerate(tokens):
        keep = matcher.feed(new)
        if keep is not None:
            got = (chunk, keep)
            break
    assert got == _naive_stop(sequences, tokens, min_tokens)


def test_cli_hardening_flags(tmp_path: Path, capsys) -> None:
    from dhisparse.serving.cli import main

    assert main(["--new-key-file", str(tmp_path / "k")]) == 0 and (tmp_path / "k").stat().st_mode & 0o077 == 0
    assert main(["--new-key-file", str(tmp_path / "k")]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err
    args = parse_args(["--engine", "E", "--admin-key-file", str(tmp_path / "k"), "--restrict-api",
                       "statistics:x-stats=v", "--no-http", "--limit", "max_words=5", "--shutdown-grace", "2"])
    options = cli_hardening.security_options(args)
    assert options.admin_key == read_key_file(tmp_path / "k").hex() and not options.allow_http
    assert options.restrictions == ("statistics:x-stats=v",)
    assert cli_hardening.request_limits(args).max_words == 5
    with pytest.raises(ValueError, match="go together"):
        cli_hardening.security_options(parse_args(["--engine", "E", "--grpc-tls-cert", str(tmp_path / "k")]))
    assert cli_hardening.version_warning("2.51.0") is not None and "CVE-2025-23310" in cli_hardening.version_warning(
        "2.51.0")
    assert cli_hardening.version_warning("2.59.1") is None and cli_hardening.version_warning("") is None
