"""Kernel selection: the CUDA kernels (resolver, host→device row copy, sparse MLA decode) in the request path
on a GPU, self-checked against the torch reference at start; the torch implementation everywhere else.

- :mod:`abi` — ctypes mirror of ``plugins/common/include/dhisparse/launch.h`` and the native libraries.
- :mod:`cuda_kernels` — :class:`CudaKernels`, launches through ``dhisparse::cuda::launch_*`` (the host code of
  the TensorRT plugins' ``enqueue``) on torch's current stream.
- :mod:`torch_kernels` — :class:`TorchKernels`, the reference and CPU path.
- :mod:`self_check` — comparison of a kernel set with the reference on random irregular inputs.
- :mod:`selection` — ``kernels = auto | cuda | torch`` → a :class:`KernelSelection`.
"""
