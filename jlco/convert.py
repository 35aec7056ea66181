"""Convert a Hugging Face DeepSeek-V3.2 checkpoint to a jlco Orbax checkpoint.

  python -m jlco.convert --checkpoint HF_DIR --output OUT_DIR [--dtype bfloat16|float32]

fp8 block-scaled weights are dequantised on the way (jlco keeps weights in one dtype);
the MTP layer is kept when the checkpoint has one. Weights stream in tensor by tensor from
the memory-mapped files (jlco.checkpoint.stream) and Orbax copies and writes at most
--save_inflight_mib at a time, so host memory holds the converted model once plus about
one tensor and that window, not every HF tensor and then the model again. The Orbax
directory restores without re-validating names and without the dequantisation pass,
which is why serving reads it; its manifest records a sha256 per leaf, checked when it
is loaded.

The output is checked first (it must be new, or an empty directory, and creatable), so an
unwritable path fails in a second rather than after loading every tensor; the directory
is written beside it and renamed into place only when complete. Bad input (checkpoint,
config.json, output path) is one `jlco.convert: error: ...` line and exit code 2.
"""

from __future__ import annotations

import json
import time

from absl import app, flags, logging

from jlco.config import ConfigError
from jlco.util import cli, compile_cache

PROG = "jlco.convert"
DTYPES = ("bfloat16", "float32")


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint directory (config.json + "
                        "model.safetensors or model.safetensors.index.json)", required=True)
    flags.DEFINE_string("output", None, "new directory for the Orbax checkpoint", required=True)
    flags.DEFINE_enum("dtype", "bfloat16", list(DTYPES), "weight dtype of the converted model")
    flags.DEFINE_bool("progress", True, "show tqdm progress on stderr")
    flags.DEFINE_integer("save_inflight_mib", 1024, "MiB of weights Orbax may copy to host "
                         "and write at once (raised to the largest weight)", lower_bound=1)


FLAGS = flags.FLAGS


def convert(checkpoint: str, output: str, dtype: str = "bfloat16", progress: bool = True,
            inflight_bytes: int | None = None) -> dict:
    """HF dir → Orbax dir; returns the summary that `main` prints. Host memory: the
    model once, about one tensor while loading, `inflight_bytes` (save_orbax) while
    saving."""
    import jax
    import ml_dtypes
    import numpy as np
    from flax import nnx

    from jlco.checkpoint.load import check_new_output, open_hf_checkpoint, save_orbax
    from jlco.checkpoint.stream import build_model
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: allowed {', '.join(map(repr, DTYPES))}")
    check_new_output(output)
    t0 = time.perf_counter()
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    index = open_hf_checkpoint(checkpoint, cfg_overrides={"dtype": dtype})
    model = build_model(index, np.dtype(np_dtype), progress=progress)   # streamed
    state = nnx.state(model)
    out = save_orbax(output, index.config, state, tokenizer_dir=checkpoint,
                     inflight_bytes=inflight_bytes)
    leaves = jax.tree.leaves(state)
    return {"checkpoint": str(index.path), "output": str(out), "dtype": dtype,
            "hf_tensors": len(index.plan), "hf_bytes": index.nbytes(np_dtype),
            "leaves": len(leaves), "bytes": int(sum(x.nbytes for x in leaves)),
            "mtp": index.has_mtp, "tokenizer": index.tokenizer_path is not None,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:  # Orbax logs every save step at INFO
        logging.set_verbosity(logging.WARNING)
    compile_cache.enable()
    from jlco.checkpoint.load import CheckpointError
    with cli.errors_exit(PROG, CheckpointError, ConfigError, ValueError, OSError):
        s = convert(FLAGS.checkpoint, FLAGS.output, FLAGS.dtype, FLAGS.progress,
                    FLAGS.save_inflight_mib << 20)
    print(f"converted {s['hf_tensors']} HF tensors ({s['hf_bytes'] / 2**20:.1f} MiB) -> "
          f"{s['leaves']} {s['dtype']} leaves ({s['bytes'] / 2**20:.1f} MiB) in {s['output']}; "
          f"MTP: {'yes' if s['mtp'] else 'no'}; tokenizer: {'yes' if s['tokenizer'] else 'no'};"
          f" {s['seconds']} s")
    print(json.dumps(s))


if __name__ == "__main__":
    define_flags()
    app.run(main)
