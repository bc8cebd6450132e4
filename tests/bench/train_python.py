#!/usr/bin/env python3
"""The PyTorch reference for kiln's training-step benchmark (`kiln bench-train`), as TRL / Unsloth run it:
transformers' model for the same config.json, SDPA attention, fused AdamW, the same sequence length, micro-batch,
accumulation and step counts on seeded random tokens (every target supervised), grad clipping at 1.0.
Prints one JSON object with the same fields as kiln's, so tests/bench/train.sh can put them side by side.

Precisions:
  bf16  weights, gradients and AdamW state in bf16 (a model loaded with dtype=bfloat16: TRL's usual run)
  amp   f32 weights and AdamW state, bf16 autocast compute (f32 master weights, as kiln's bf16 mode)
  f32   everything in f32

`table FILE...` prints a markdown table of result files (kiln's and this script's) with kiln/PyTorch ratios.
"""

import argparse
import json
import statistics
import sys
import time


def attention_width(config: dict, seq: int) -> float:
    """Σ over softmax-attention layers of heads × head_dim, as kiln's MFU formula counts them: Gemma 4's
    full layers at `global_head_dim`, its sliding-window layers in the proportion min(seq, window) / seq."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = ["full_attention" if i in config.get("full_attn_idxs", []) else "conv"
                       for i in range(config["num_hidden_layers"])]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    full = sum(1 for t in layer_types if t == "full_attention") * heads * (config.get("global_head_dim") or head_dim)
    sliding = sum(1 for t in layer_types if t == "sliding_attention") * heads * head_dim
    return full + sliding * min(seq, config.get("sliding_window") or seq) / seq


def flops_params(named_parameters, config: dict) -> int:
    """The parameters a token multiplies through, as kiln's `ModelConfig::flops_share` counts them: an MoE's
    experts at num_experts_per_tok / num_experts; an input embedding table (a lookup) only when it is also
    the tied LM head (named_parameters lists a tied head once, as the embedding); Gemma 4's per-layer
    embedding table not at all."""
    named = list(named_parameters)
    untied = any(name == "lm_head.weight" for name, _ in named)
    total = 0.0
    for name, p in named:
        if name.endswith("embed_tokens_per_layer.weight") or (untied and name.endswith("embed_tokens.weight")):
            continue
        share = config["num_experts_per_tok"] / config["num_experts"] if ".experts." in name else 1.0
        total += p.numel() * share
    return round(total)


def peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_config(config: str) -> dict:
    path = config if config.endswith(".json") else f"{config}/config.json"
    with open(path) as f:
        return json.load(f)


def run_fields(args, model_type: str) -> dict:
    """What a row ran, the fields kiln's `BenchRun` shares."""
    return {
        "framework": "pytorch",
        "model_type": model_type,
        "device": args.device.split(":")[0],
        "precision": args.precision,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "accumulation": args.accumulation,
        "docs_per_row": 1,
        "activation_checkpointing": args.gradient_checkpointing,
        "attn_implementation": args.attn,
    }


def bench(args) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config(args.config)
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "dtype")}
    config = AutoConfig.for_model(raw["model_type"], **fields)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    weights_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype, attn_implementation=args.attn)
    model.to(device).train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")
    n_params = sum(p.numel() for p in params)
    vocab = raw["vocab_size"]
    generator = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.seq * args.micro_batch * args.accumulation
    autocast = args.precision == "amp"
    cuda = device.type == "cuda"
    warmup_seconds, step_seconds, losses = [], [], []
    for step in range(args.warmup + args.steps):
        batches = [torch.randint(0, vocab, (args.micro_batch, args.seq), generator=generator).to(device)
                   for _ in range(args.accumulation)]
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        total = 0.0
        for ids in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss / args.accumulation
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        losses.append(total)
        (step_seconds if step >= args.warmup else warmup_seconds).append(seconds)
    median = statistics.median(step_seconds)
    n_flops = flops_params(model.named_parameters(), raw)
    flops = 6 * n_flops * tokens_per_step + 12 * attention_width(raw, args.seq) * args.seq * tokens_per_step
    return {
        **run_fields(args, raw["model_type"]),
        "params": n_params,
        "flops_params": n_flops,
        "tokens_per_step": tokens_per_step,
        "warmup": args.warmup,
        "warmup_seconds": warmup_seconds,
        "step_seconds": step_seconds,
        "median_step_seconds": median,
        "tokens_per_s": tokens_per_step / median,
        "mfu": flops / (median * args.peak_tflops * 1e12) if args.peak_tflops else None,
        "peak_memory_bytes": torch.cuda.max_memory_reserved(device) if cuda else peak_rss_bytes(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "losses": losses,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def table(files) -> str:
    results = []
    for name in files:
        with open(name) as f:
            results.append(json.load(f))
    lines = ["| shape | framework | precision | params M | seq × micro × acc | tokens/s | MFU % | peak GiB | state GiB | kiln / PyTorch tokens/s | kiln / PyTorch memory |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    measured = [r for r in results if "out_of_memory" not in r]
    for r in results:
        shape = r.get("shape", r["model_type"])
        mfu = f"{r['mfu'] * 100:.1f}" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f}" if r.get("peak_memory_bytes") else "-"
        # kiln's weights, gradients and optimizer state between steps (the peak adds activations).
        state = f"{r['state_memory_bytes'] / 2**30:.2f}" if r.get("state_memory_bytes") else "-"
        ratio = mem_ratio = ""
        if r["framework"] == "kiln" and r in measured:
            refs = [o for o in measured if o["framework"] == "pytorch" and o.get("shape", o["model_type"]) == shape]
            ratio = " ".join(f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}× ({o['precision']})" for o in refs)
            mem_ratio = " ".join(f"{r['peak_memory_bytes'] / o['peak_memory_bytes']:.2f}× ({o['precision']})"
                                 for o in refs if o.get("peak_memory_bytes") and r.get("peak_memory_bytes"))
        framework = r["framework"] + (" (reference ops)" if r.get("reference_ops") else "") \
            + (" (unfused)" if r.get("fusion") is False else "") \
            + (" (burn's autotune)" if r.get("autotune") else "") \
            + (" (cuBLAS matmuls)" if r.get("matmul") == "cublas" else "") \
            + (" (cuBLAS matmuls ordered by the host)" if r.get("matmul") == "cublas-host" else "") \
            + (" (no scan kernel)" if r.get("scan_kernel") is False else "") \
            + (" (no attention kernels)" if r.get("attention_kernel") is False else "") \
            + (" (no loss kernel)" if r.get("loss_kernel") is False else "") \
            + (" (no norm kernels)" if r.get("norm_kernel") is False else "") \
            + (" (no conv kernels)" if r.get("conv_kernel") is False else "") \
            + (" (no optimizer kernels)" if r.get("optim_kernel") is False else "") \
            + (" (optimizer kernels on)" if r.get("optim_kernel") and r.get("device") == "cuda" else "") \
            + (" (a matmul per expert)" if r.get("experts_batched") is False else "") \
            + (" (checkpointed)" if r.get("activation_checkpointing") else "") \
            + (f" (attention chunks of {r['attention_chunk_mib']} MiB)"
               if r.get("attention_chunk_mib") not in (None, 256) else "") \
            + (f" ({r['moments']} moments)" if r.get("moments", "f32") != "f32" else "") \
            + (" (no masters: stochastic rounding)" if r.get("masters") == "stochastic" else "")
        params = f"{r['params'] / 1e6:.1f}" if "params" in r else "-"
        if r.get("flops_params") not in (None, r.get("params")):
            params += f" ({r['flops_params'] / 1e6:.1f} in MFU)"
        speed = "out of memory" if "out_of_memory" in r else f"{r['tokens_per_s']:,.0f}"
        lines.append(f"| {shape} | {framework} | {r['precision']} | {params} | "
                     f"{r['seq']} × {r['micro_batch']} × {r['accumulation']} | {speed} | {mfu} | "
                     f"{mem} | {state} | {ratio} | {mem_ratio} |")
    # Where cuBLAS computed the products: what the ordering around them (kernels/cublas.rs) cost the host a step.
    for r in measured:
        tally = r.get("cublas")
        if not tally:
            continue
        step, shape = r["median_step_seconds"], r.get("shape", r["model_type"])
        lines.append("")
        if r.get("matmul") == "cublas-host":
            lines.append(f"{shape}, kiln with cuBLAS ordered by the host: {tally['products']} products a step, "
                         f"{tally['operand_wait_s'] * 1e3:.1f} ms waiting for cubecl's stream before them and "
                         f"{tally['product_s'] * 1e3:.1f} ms from their calls to their streams' ends, of a "
                         f"{step * 1e3:.1f} ms step (the rest: the host between products)")
        else:
            lines.append(f"{shape}, kiln with cuBLAS ordered on the device: {tally['products']} products a step, "
                         f"{tally['product_s'] * 1e3:.1f} ms of the host's time queueing them and their flag "
                         f"kernels, of a {step * 1e3:.1f} ms step")
    return "\n".join(lines)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "table":
        print(table(sys.argv[2:]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a config.json or a folder holding one")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["bf16", "amp", "f32"], default="bf16")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--shape", default=None, help="a name for the table (default: the model type)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    try:
        result = bench(args)
    except torch.OutOfMemoryError as e:
        # A row saying so, as kiln writes one, and exit status 3 (kiln's): tests/bench/train.sh keeps the row
        # and tries nothing else.
        result = {**run_fields(args, read_config(args.config)["model_type"]), "out_of_memory": str(e).splitlines()[0]}
        print(f"train_python.py: out of device memory: {result['out_of_memory']}", file=sys.stderr)
    if args.shape:
        result["shape"] = args.shape
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    if "out_of_memory" in result:
        sys.exit(3)


if __name__ == "__main__":
    main()
