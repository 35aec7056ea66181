"""Write a DeepSeek-style fp8 copy of a HF checkpoint: e4m3 weights + 128×128 block scales.

The real DeepSeek-V3.2 checkpoint ships its linear weights this way (docs/facts.md §1); this tool
makes small ones for tests and demos from any f32/bf16/f16 checkpoint. `--twin` also
writes the dequantised weights as f32 (same layout, no scales): loading the fp8 copy must
give exactly the twin's tensors, which separates dequantisation bugs from fp8 rounding.

  python -m tools.make_fp8_checkpoint --checkpoint HF_DIR --output FP8_DIR [--twin F32_DIR]
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from typing import Callable

import numpy as np

from jlco.checkpoint import safetensors_io as st

# Linear weights the official checkpoint stores in fp8. The router gate, the indexer's
# head weights (`weights_proj`, kept in f32 by transformers), norms, embeddings and output
# heads stay in their source dtype.
_FP8_NAME = re.compile(r".*\.(\w+_proj|wq_b|wk)\.weight")
_KEEP = re.compile(r".*\.weights_proj\.weight")
_COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json")


def default_should_quantize(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and bool(_FP8_NAME.fullmatch(name)) and not _KEEP.fullmatch(name)


def _shards(src: pathlib.Path) -> dict[str, list[str]]:
    """Source shard file name → tensor names in it (one 'model.safetensors' if unsharded)."""
    entries = st.index_checkpoint(src)
    out: dict[str, list[str]] = {}
    for name, e in entries.items():
        out.setdefault(e.file.name, []).append(name)
    return out


def _prepare(dst: pathlib.Path, src: pathlib.Path, fp8: bool) -> None:
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"output {str(dst)!r} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    for fname in _COPY_FILES:
        if (src / fname).is_file():
            shutil.copyfile(src / fname, dst / fname)
    if fp8:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [st.FP8_BLOCK, st.FP8_BLOCK]}
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def make_fp8_checkpoint(src, dst, twin=None,
                        should_quantize: Callable[[str, tuple], bool] = default_should_quantize
                        ) -> dict:
    """Quantise `src` into `dst` (and its f32 twin into `twin`); returns a summary dict."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    twin = pathlib.Path(twin) if twin is not None else None
    entries = st.index_checkpoint(src)
    _prepare(dst, src, fp8=True)
    if twin is not None:
        _prepare(twin, src, fp8=False)
    maps: dict[str, dict[str, str]] = {"fp8": {}, "twin": {}}
    n_q = 0
    for shard, names in _shards(src).items():
        out, out_twin = {}, {}
        for name in names:
            e = entries[name]
            if e.dtype == "F8_E4M3":
                raise ValueError(f"tensor {name!r} ({shard}) is already fp8")
            w = np.asarray(st.read_tensor(e))
            if should_quantize(name, e.shape):
                q, s = st.quantize_fp8_blocks(w)
                out[name], out[name + "_scale_inv"] = q, s
                out_twin[name] = st.dequantize_fp8_blocks(q, s)
                n_q += 1
            else:
                out[name] = out_twin[name] = w
        st.write_safetensors(dst / shard, out)
        maps["fp8"].update({k: shard for k in out})
        if twin is not None:
            st.write_safetensors(twin / shard, out_twin)
            maps["twin"].update({k: shard for k in out_twin})
    if (src / st.INDEX_FILE).is_file():
        for d, key in ((dst, "fp8"), (twin, "twin")):
            if d is not None:
                (d / st.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map":
                                                           dict(sorted(maps[key].items()))}))
    return {"tensors": len(entries), "quantized": n_q, "output": str(dst),
            "twin": str(twin) if twin else None}


def main(argv):
    del argv
    from absl import flags
    f = flags.FLAGS
    print(json.dumps(make_fp8_checkpoint(f.checkpoint, f.output, f.twin), indent=1))


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_string("checkpoint", None, "source HF checkpoint directory", required=True)
    flags.DEFINE_string("output", None, "new directory for the fp8 copy", required=True)
    flags.DEFINE_string("twin", None, "optional new directory for the dequantised f32 twin")
    app.run(main)
