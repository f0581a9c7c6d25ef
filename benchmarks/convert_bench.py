"""Conversion throughput (MB/s of source tensors) and peak RSS of ``to_native``, eager vs lazy.

Models:
  * SmolLM2-135M-Instruct: from its GGUF (``grpax.checkpoint.gguf``) and from a bfloat16 Hugging Face export of
    it (GGUF -> native -> ``to_huggingface``), so the safetensors path is measured on real shapes.
  * A synthetic random Llama with the ``llama3.2-1b`` shapes (1.24 B parameters), written with numpy as sharded
    bfloat16 safetensors (``model.safetensors.index.json``), as the Hub ships it.

Each conversion runs in its own subprocess; peak RSS is that child's ``ru_maxrss`` read by a wrapper process
with ``resource.getrusage(RUSAGE_CHILDREN)``. Goal (lazy): peak RSS < 2 x the largest stacked tensor + 1 GB.
The 1.24 B model is also converted with ``use_compression=False`` (Orbax's zstd off) and its output restored
(``restore_params`` to numpy, in a fresh process) to time the read back. The load average is printed before and
after: the machine is shared.

    python benchmarks/convert_bench.py --workdir /tmp/convert_bench [--skip-1b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

_CHILD = r"""
import json, resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
seconds = time.perf_counter() - start
if done.returncode:
    sys.stderr.write(done.stderr[-3000:])
    sys.exit(done.returncode)
summary = json.loads(done.stdout.strip().splitlines()[-1])
print(json.dumps({"seconds": seconds, "convert_seconds": summary["convert_seconds"],
                  "peak_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""

_RESTORE = r"""
import json, sys, time
from grpax.checkpoint.orbax import restore_params
start = time.perf_counter()
restore_params(json.loads(sys.argv[1]))
print(json.dumps({"convert_seconds": time.perf_counter() - start}))
"""

_CONVERT = r"""
import json, sys, time
from grpax.checkpoint.convert import to_native
kwargs = json.loads(sys.argv[1])
start = time.perf_counter()
summary = to_native(progress=False, **kwargs)
summary["convert_seconds"] = time.perf_counter() - start
print(json.dumps(summary))
"""


def measure(kwargs: dict, script: str = _CONVERT) -> dict:
    """Runs one ``to_native`` (or ``script``) in a fresh process, inside a wrapper that reads its peak RSS."""
    cmd = [sys.executable, "-c", _CHILD, sys.executable, "-c", script, json.dumps(kwargs)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_synthetic(folder: Path, model_name: str = "llama3.2-1b", shard_bytes: int = 1 << 30) -> int:
    """Writes a random bfloat16 Llama (registered shapes of ``model_name``) as sharded safetensors."""
    from safetensors.numpy import save_file

    from grpax.checkpoint.hf import expected_hf_names, hf_layer_name, native_to_hf
    from grpax.models.params import abstract_params
    from grpax.models.registry import get_model_config, to_hf_config

    cfg = get_model_config(model_name, scan_layers=False)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    tree = abstract_params(cfg)
    shapes = {"model.embed_tokens.weight": tree["embed"].shape, "model.norm.weight": tree["final_norm"].shape}
    if "lm_head" in tree:
        shapes["lm_head.weight"] = tree["lm_head"].shape[::-1]
    for i, layer in enumerate(tree["layers"]):
        for name, leaf in layer.items():
            hf_shape = native_to_hf(name, np.empty(leaf.shape, np.int8), cfg).shape
            shapes[hf_layer_name(i, name, cfg)] = hf_shape
    assert sorted(shapes) == sorted(expected_hf_names(cfg))
    rng = np.random.default_rng(0)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        w = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if size and size + w.nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = w
        size += w.nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        total += sum(v.nbytes for v in shard.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def largest_stacked_bytes(model_name: str, weight_dtype: str) -> int:
    from grpax.models.params import abstract_params
    from grpax.models.registry import get_model_config

    cfg = get_model_config(model_name, scan_layers=True, weight_dtype=weight_dtype)
    import jax

    return max(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract_params(cfg)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="/tmp/grpax_convert_bench")
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--weight-dtype", default="bfloat16")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    from grpax.checkpoint.convert import to_huggingface, to_native
    from grpax.checkpoint.gguf import default_gguf_path

    rows = []
    print("load average before:", os.getloadavg(), flush=True)

    def run(label, model_name, source_bytes, restore=False, **kwargs):
        out = work / f"out_{len(rows)}"
        kwargs = {
            "model_name": model_name,
            "base_output_directory": str(out),
            "weight_dtype": args.weight_dtype,
            **kwargs,
        }
        m = measure(kwargs)
        items = out / "0" / "items"
        out_bytes = sum(f.stat().st_size for f in items.rglob("*") if f.is_file())
        big = largest_stacked_bytes(model_name, args.weight_dtype)
        row = {
            "case": label,
            "source_MB": source_bytes / 1e6,
            "output_MB": out_bytes / 1e6,
            "seconds": round(m["seconds"], 2),
            "convert_seconds": round(m["convert_seconds"], 2),
            "MB_per_s": round(source_bytes / 1e6 / m["convert_seconds"], 1),
            "peak_rss_GB": round(m["peak_rss_kb"] * 1024 / 1e9, 3),
            "goal_GB": round((2 * big + 1e9) / 1e9, 3),
        }
        if restore:
            r = measure(str(items), script=_RESTORE)
            row["restore_seconds"] = round(r["convert_seconds"], 2)
            row["restore_peak_rss_GB"] = round(r["peak_rss_kb"] * 1024 / 1e9, 3)
        shutil.rmtree(out, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)

    gguf = default_gguf_path()
    run(
        "smollm2-135m GGUF Q4_1 (dequantised)", "smollm2-135m-Instruct", os.path.getsize(gguf), gguf_path=gguf
    )
    to_native("smollm2-135m-Instruct", work / "smol_native", gguf_path=gguf, progress=False)
    to_huggingface(
        work / "smol_native" / "0" / "items", work / "smol_hf", weight_dtype="bfloat16", progress=False
    )
    smol_bytes = sum(f.stat().st_size for f in (work / "smol_hf").glob("*.safetensors"))
    for lazy in (False, True):
        run(
            f"smollm2-135m HF bf16 {'lazy' if lazy else 'eager'}",
            "smollm2-135m-Instruct",
            smol_bytes,
            hf_model_path=str(work / "smol_hf"),
            lazy_load_tensors=lazy,
        )
    if not args.skip_1b:
        start = time.perf_counter()
        total = write_synthetic(work / "synthetic_1b")
        print(
            f"wrote synthetic 1.24B model ({total / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        for lazy, compress in ((True, True), (True, False), (False, True)):
            run(
                f"synthetic llama3.2-1b HF bf16 sharded {'lazy' if lazy else 'eager'}"
                + ("" if compress else " no-zstd"),
                "llama3.2-1b",
                total,
                restore=lazy,
                hf_model_path=str(work / "synthetic_1b"),
                lazy_load_tensors=lazy,
                use_compression=compress,
            )
    print("load average after:", os.getloadavg(), flush=True)
    print(
        "\n| case | source MB | output MB | process s | convert s | MB/s | peak RSS GB | goal GB | restore s "
        "| restore RSS GB |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['case']} | {r['source_MB']:.0f} | {r['output_MB']:.0f} | {r['seconds']} | "
            f"{r['convert_seconds']} | {r['MB_per_s']} | {r['peak_rss_GB']} | {r['goal_GB']} | "
            f"{r.get('restore_seconds', '')} | {r.get('restore_peak_rss_GB', '')} |"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
