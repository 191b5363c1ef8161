"""How ``kvtier serve`` sizes its device pool on a GPU when no size flag is given.

Loads a checkpoint (``--checkpoint DIR``), or builds one first: a Llama-3-8B-sized config with
weights written by transformers' own ``save_pretrained`` in bfloat16 in a temporary directory
(no network: the weights are zeros, which size the same as trained ones). Then runs the
server's sizing path (``kvtier.server.lifecycle.build_engine``, the flags' defaults: no
``--device-pages``, ``--mem-fraction`` 0.9) on CUDA and reports the device memory free before
anything, the weights' bytes, the memory free once they are on the device, the workspace
estimate, the KV bytes the device pool allocated and the share of the memory left after the
weights that it takes. Then checks that the rest suffices: a full ``--max-prefill-tokens``
prefill and a batch of ``--max-running`` requests decoding, with the peak memory they reached.

    python results/serve-sizing/measure.py --out results/serve-sizing/h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LLAMA_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
"""Llama-3-8B's shapes (its RoPE base below; no scaling: the sizes do not depend on it)."""
ROPE_THETA = 500000.0


def build_checkpoint(directory: Path) -> float:
    """Write a Llama-8B-sized bfloat16 checkpoint to ``directory`` with ``save_pretrained``;
    returns the seconds it took. The weights are zeros: allocated without transformers'
    random initialisation (which takes minutes on a CPU for 8B parameters) and then zeroed,
    so the files are deterministic."""
    import torch
    import transformers

    began = time.perf_counter()
    major = int(transformers.__version__.split(".")[0])
    rope = (
        {"rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}}
        if major >= 5
        else {"rope_theta": ROPE_THETA}
    )
    config = transformers.LlamaConfig(**LLAMA_8B, **rope)
    try:  # transformers 5.x, then 4.x
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    dtype = {"dtype" if major >= 5 else "torch_dtype": torch.bfloat16}
    with no_init_weights():
        model = transformers.LlamaForCausalLM._from_config(config, **dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.save_pretrained(directory)
    del model
    return time.perf_counter() - began


def measure(checkpoint: Path, max_prefill_tokens: int, max_running: int) -> dict[str, Any]:
    """The sizing figures (see the module docstring) of serving ``checkpoint`` on CUDA."""
    import torch

    from kvtier.engine import SamplingParams
    from kvtier.server.lifecycle import EngineSpec, build_engine
    from kvtier.server.sizing import SizeRequest

    device = torch.device("cuda")
    torch.cuda.init()
    free_before, total = torch.cuda.mem_get_info(device)
    began = time.perf_counter()
    spec = EngineSpec(
        model=str(checkpoint),
        cache={"device": "cuda"},
        sizes=SizeRequest(),  # no size flag: --mem-fraction's default
        max_running=max_running,
        max_prefill_tokens=max_prefill_tokens,
    )
    engine = build_engine(spec)
    build_s = time.perf_counter() - began
    llm, plan = engine.llm, engine.plan
    stats = llm.stats()
    weights = sum(t.numel() * t.element_size() for t in (*llm.model.parameters(),))
    kv = int(stats["device_bytes_total"])
    free_after_build = torch.cuda.mem_get_info(device)[0]
    free_after_weights = int(plan.free_bytes)
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "total_bytes": total,
        "free_before_bytes": free_before,
        "weights_bytes": weights,
        "free_after_weights_bytes": free_after_weights,
        "workspace_estimate_bytes": plan.workspace_bytes,
        "mem_fraction": spec.sizes.mem_fraction,
        "device_pages": int(stats["device_pages_total"]),
        "page_tokens": llm.cache.page_size,
        "kv_bytes_allocated": kv,
        "kv_tokens": int(stats["device_pages_total"]) * llm.cache.page_size,
        "kv_fraction_of_free_after_weights": kv / free_after_weights,
        "kv_fraction_of_free_before_less_weights": kv / (free_before - weights),
        "free_after_build_bytes": free_after_build,
        "host_bytes": int(stats.get("host_bytes_total", 0)),
        "context_tokens": engine.context_tokens,
        "device_reason": plan.device_reason,
        "host_reason": plan.host_reason,
        "summary": engine.summary,
        "build_seconds": build_s,
    }
    # Does what the pool left suffice? A full prefill step, then max_running requests decoding.
    torch.cuda.reset_peak_memory_stats(device)
    checks: dict[str, Any] = {}
    try:
        prompt = [(7 * i) % 1000 + 1 for i in range(max_prefill_tokens - 8)]
        llm.generate([prompt], SamplingParams(max_tokens=8))
        checks["prefill_ok"] = True
        prompts = [[i + 1, *range(2, 130)] for i in range(max_running)]
        llm.generate(prompts, SamplingParams(max_tokens=32))
        checks["decode_batch_ok"] = True
    except torch.cuda.OutOfMemoryError as e:
        checks["error"] = f"out of memory: {e}"
    checks["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    checks["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    checks["free_after_checks_bytes"] = torch.cuda.mem_get_info(device)[0]
    out["checks"] = checks
    llm.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--checkpoint", help="a checkpoint directory (default: build a Llama-8B one)")
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--max-running", type=int, default=16)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("measure.py needs a CUDA device", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-sizing-") as tmp:
        built_s = None
        checkpoint = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "llama-8b"
        if not args.checkpoint:
            built_s = build_checkpoint(checkpoint)
        result = measure(checkpoint, args.max_prefill_tokens, args.max_running)
    result["checkpoint"] = args.checkpoint or "Llama-8B shapes, zero bfloat16 weights"
    result["checkpoint_build_seconds"] = built_s
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    gib = 1 << 30
    print(
        f"free before {result['free_before_bytes'] / gib:.2f} GiB, weights "
        f"{result['weights_bytes'] / gib:.2f} GiB, free after weights "
        f"{result['free_after_weights_bytes'] / gib:.2f} GiB, KV "
        f"{result['kv_bytes_allocated'] / gib:.2f} GiB "
        f"({result['kv_fraction_of_free_after_weights']:.1%} of what the weights left), "
        f"checks {result['checks']}"
    )
    return 0 if "error" not in result["checks"] else 1


if __name__ == "__main__":
    sys.exit(main())
