"""What the Python tests share, imported as ``support.<module>`` from every test folder (tests/python/conftest.py
puts tests/python on sys.path; a subprocess a test starts inserts :data:`TESTS` itself). No test module imports
another test module: a helper two of them need lives here.

- ``attention``: the float64 ReRoPE references (two-matrix and IEEE), random inputs, layouts, the SDPA error bound
- ``paged``: the one builder of vLLM-style paged batches (``make_paged``) and their float64 reference
- ``tiny_lm``: tiny transformers models (the Llama family, the evaluator's Llama), a character tokenizer, a passkey stub
- ``bad_input``: the runner of the table-driven bad-input suites
- ``vllm_testing``: the vLLM leg's import rule, the tiny Llama it serves (``served_llama``, a ``tiny_llama``), the
  comparison with transformers
- ``two_ranks``: the one runner of checks on two spawned ranks (gloo on CPU; NCCL on CUDA)
- ``cpu_ring_attention``: PyTorch's context-parallel ring attention with CPU SDPA's kernel
- ``vllm_engine``: the one vLLM engine runner (``run_engines``: engines in one subprocess, outputs as JSON)
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/python
ROOT = TESTS.parents[1]  # the repository
