"""Import stub of SGLang's kernel library ``sgl_kernel`` for SGLang's CPU engine on a machine without its CPU build
(scripts/setup_sglang.sh puts this folder on .venv-sglang's path; see README.md here).

It defines only the names SGLang imports at import time on the CPU engine's path (``SGLANG_USE_CPU_ENGINE=1``), and
every one raises when called: the engine running a model with this stub proves that nothing calls them. Any other
name is missing, as it would be without the library (``from sgl_kernel import other`` raises ImportError).
"""

__version__ = "0.0.0+ropescale.stub"

#: The names sglang 0.5.23 imports under `if is_cpu():` at module level (the file that does), each raising when called;
#: all but the first two are speculative decoding kernels.
NAMES = (
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py
    "assign_req_to_token_pool_cpu",  # sglang/srt/mem_cache/allocation.py
    "build_tree_kernel_efficient_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "verify_tree_greedy_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "assign_draft_cache_locs_contiguous_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "assign_extend_cache_locs_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "fill_accept_out_cache_loc_cpu",  # sglang/kernels/ops/speculative/eagle.py
    "fill_bonus_tokens_cpu",  # sglang/kernels/ops/speculative/eagle.py
)


def _stub(name):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is ropescale's import stub "
            "(scripts/sglang_cpu_stub): no CPU build of SGLang's kernel library is on PyPI")

    call.__name__ = call.__qualname__ = name
    return call


globals().update({name: _stub(name) for name in NAMES})
__all__ = list(NAMES)
