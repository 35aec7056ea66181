"""The one place where the model's two custom ops pick an implementation.

  impl="auto"       one jitted program; `lax.platform_dependent` lowers it to the Triton
                    kernel for cuda, the Mosaic kernel for tpu and the plain-XLA `*_ref`
                    elsewhere (CPU): the serving path never runs a kernel in interpret mode,
                    whose grid loops carry whole operands (a decode step that grows with
                    context).
  impl="interpret"  as "auto" on accelerators, the interpret-mode kernel elsewhere: the test
                    tool that runs on CPU the same kernel code the accelerators compile.
  impl="xla"        the plain-jnp `*_ref` of each kernel everywhere: the fallback when a
                    kernel misbehaves on new hardware, the baseline benchmarks compare to.
  impl="pallas"     the accelerator kernel; lowering for a platform without one (CPU) fails
                    with an error that says so, instead of silently interpreting.

Block sizes come from `tuning.lookup`, per platform branch, never from the call site.
"""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jlco.pallas import indexer as ix
from jlco.pallas import indexer_ref as ixr
from jlco.pallas import sparse_mla as smla
from jlco.pallas import tuning

IMPLS = ("auto", "xla", "pallas", "interpret")

_no_kernel_p = Primitive("jlco_no_pallas_kernel")
_no_kernel_p.def_abstract_eval(lambda x, *, op: x)


def _no_kernel_lowering(ctx, x, *, op):
    platforms = ", ".join(getattr(ctx.module_context, "platforms", None) or ["this one"])
    raise ValueError(f"{op}: impl='pallas' has no Pallas kernel for platform {platforms} "
                     f"(kernels exist for cuda and tpu); use impl='auto' or 'xla' (plain XLA), "
                     f"or impl='interpret' to run the kernel in Pallas interpret mode (a "
                     f"test tool: slow)")


mlir.register_lowering(_no_kernel_p, _no_kernel_lowering)


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is invalid: allowed {IMPLS}")


def resolve(impl: str) -> str:
    """The implementation for programs that run on this process's devices: "auto" is
    "xla" when every device is a CPU (what "auto" lowers to there, bit for bit) without
    tracing the cuda and tpu kernel branches that `lax.platform_dependent` traces and
    then drops (~0.5 s of a warm-cache `jlco.generate` on a 2-core CPU). A caller that
    lowers for another platform (jax.export, `lowering_platforms`) passes impl itself."""
    _check_impl(impl)
    if impl == "auto" and all(d.platform == "cpu" for d in jax.devices()):
        return "xla"
    return impl


def _per_platform(op, kernel_for, ref, impl):
    """platform_dependent over kernels; `kernel_for(platform)` builds a zero-arg branch."""
    if impl == "interpret":
        default = kernel_for("cpu")
    elif impl == "auto":
        default = ref
    else:
        def default():
            return jax.tree.map(functools.partial(_no_kernel_p.bind, op=op), ref())
    return jax.lax.platform_dependent(cuda=kernel_for("cuda"), tpu=kernel_for("tpu"),
                                      default=default)


def _fit_block_h(block_h, heads, platform):
    """Tuned heads-per-program narrowed to this call: it must divide `heads` (Triton also
    needs a power of two >= 16); None lets the kernel choose (it pads small head counts)."""
    b = block_h
    while b >= 1 and heads % b:
        b //= 2
    if b < 1 or (platform == "cuda" and b < 16):
        return None
    return b


@functools.partial(jax.jit, static_argnames=("softmax_scale", "kv_format", "d_rope", "impl"))
def sparse_mla(q, kv_cache, indices, softmax_scale, *, kv_format, d_rope, impl="auto"):
    """Absorbed sparse MLA decode: (out [b, s_q, h, d_nope], lse [b, s_q, h]); see
    `jlco.pallas.sparse_mla` for the contract."""
    _check_impl(impl)
    args = (q, kv_cache, indices, softmax_scale)
    kw = dict(kv_format=kv_format, d_rope=d_rope)
    ref = functools.partial(smla.sparse_mla_decode_ref, *args, **kw)
    if impl == "xla":
        return ref()
    heads = q.shape[2]
    topk_pow2 = max(16, 1 << (indices.shape[2] - 1).bit_length())
    backend = {"cuda": "triton", "tpu": "mosaic_tpu", "cpu": "triton"}

    def kernel_for(platform):
        blocks = tuning.lookup("sparse_mla", platform=platform, dtype=kv_format, heads=heads)
        extra = {k: blocks[k] for k in ("num_warps", "num_stages") if k in blocks}
        return functools.partial(
            smla.sparse_mla_decode, *args, **kw, backend=backend[platform],
            interpret=platform == "cpu", block_k=min(blocks["block_k"], topk_pow2),
            block_h=_fit_block_h(blocks["block_h"], heads, platform), **extra)

    with jax.named_scope("dispatch_sparse_mla"):
        return _per_platform("sparse_mla", kernel_for, ref, impl)


@functools.partial(jax.jit, static_argnames=("topk", "key_format", "impl"))
def indexer_topk(q, weights, k_cache, lengths, topk, *, k_scale=None, key_format="bf16",
                 impl="auto", fresh=None):
    """Lightning-indexer top-k: (indices [b, s_q, topk] int32, scores [b, s_q, topk] f32);
    see `jlco.pallas.indexer` for the contract (`fresh`: `indexer_topk_ref`; a kernel
    is given the cache with the fresh keys written, `write_fresh`)."""
    _check_impl(impl)
    # XLA everywhere but the kernels' platforms; on a CPU backend the reference's stream
    # with the native kernels' scores and top-k (`native_cpu`), chosen here only.
    ref = functools.partial(ixr.indexer_topk_ref, q, weights, k_cache, lengths, topk,
                            k_scale=k_scale, key_format=key_format, fresh=fresh,
                            native_cpu=True)
    if impl == "xla":
        return ref()
    backend = {"cuda": "triton", "tpu": "mosaic", "cpu": "triton"}

    def kernel_for(platform):
        # indexer.py reads tuning.lookup for `platform` itself (block_n=None).
        def run():
            keys, scale = ixr.write_fresh(k_cache, k_scale, fresh)
            return ix.indexer_topk(q, weights, keys, lengths, topk, k_scale=scale,
                                   key_format=key_format, backend=backend[platform],
                                   interpret=platform == "cpu")
        return run

    with jax.named_scope("dispatch_indexer_topk"):
        return _per_platform("indexer_topk", kernel_for, ref, impl)
