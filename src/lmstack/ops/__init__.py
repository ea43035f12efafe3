"""Ops: the kernel choices the model's layers call, below ``lmstack.model`` (it imports nothing of lmstack but
``lmstack.cpu``). ``gemm``: CPU fp32 GEMM dispatch (oneDNN or torch's BLAS, per CPU) and the MoE experts'
grouped GEMMs. ``kernels.runtime.configure`` is what sets the policy a run uses."""
