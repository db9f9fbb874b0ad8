"""Export memory and time at real model sizes: random weights with the exact shapes of released models.

For each shape (Llama-3.2-1B, Qwen3-4B, Llama-3.1-8B, Qwen3-30B-A3B at 4 layers; their configs' numbers are
written here, nothing is downloaded) this writes a Hugging Face folder once: config.json, bf16 safetensors
in shards, an index, a word-level tokenizer of the model's vocabulary size and generation_config.json. The
weights are generated tensor by tensor from the names and shapes of the model built on the meta device, so
writing an 8B folder holds one shard (~2 GB), never the model. The folders have the models' speed and
memory, never their quality.

Then it runs ``popcompile export FOLDER --out ENGINE --weights W --kv-calibration none --min-prompt-tokens 0
--json`` (``--kv-calibration ridge``: with the POP+ fit, its estimate and time recorded) in a child
process and records, as one JSON row: the child's peak RSS (getrusage of the reaped
child, and psutil samples of it), wall seconds, the engine folder's size, the export's per-step records
(``steps``: wall seconds and peak RSS of each step, from its --json output, or from its stderr lines when it
did not finish) and how it ended (ok, failed, killed: over ``--rss-limit-gib``, or past ``--timeout``). The
watchdog kills the child's process group above the limit, so the machine survives an export that would not.

    python benchmarks/real_shapes.py --shape llama-3.2-1b --weights int4 --json rows.jsonl
    python benchmarks/real_shapes.py --shape llama-3.1-8b --weights int4 --rss-limit-gib 21
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
_DONE = ".real_shapes_complete"

#: the released models' configs, number for number (their config.json on the hub)
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 128000,
                     "eos_token_id": 128001, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                     "rope_parameters": {**_LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 32.0}},
    "qwen3-4b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
                 "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 151643,
                 "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 128000,
                     "eos_token_id": 128001, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                     "rope_parameters": {**_LLAMA3_ROPE, "rope_theta": 500000.0, "factor": 8.0}},
    # Qwen3-30B-A3B's config at 4 of its 48 layers (128 experts of width 768, 8 per token): its layers' memory
    # and speed, a quarter of the experts' weights that fit this machine in float32
    "qwen3-30b-a3b-4l": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                         "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                         "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4,
                         "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                         "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
                         "hidden_act": "silu", "attention_bias": False,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
}
SHARD_BYTES = 2 * GIB


def hf_config(shape: str):
    """The transformers config of ``shape`` (LlamaConfig / Qwen3Config / Qwen3MoeConfig), bf16."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    fields = dict(SHAPES[shape])
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[fields.pop("model_type")]
    return cls(**fields, dtype="bfloat16")


def write_checkpoint(shape: str, folder: Path, seed: int = 0) -> Path:
    """A random bf16 checkpoint of ``shape`` in ``folder`` (kept: reused when complete), shard by shard."""
    if (folder / _DONE).is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = hf_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # names and shapes only; a tied head is the embedding (transformers re-ties it on load)
    tensors = {name: p.shape for name, p in model.named_parameters(remove_duplicate=True)}
    generator = torch.Generator().manual_seed(seed)
    index, shard, shard_bytes, shards = {}, {}, 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shards.append(name)
        shard, shard_bytes = {}, 0

    for name, size in tensors.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(size, dtype=torch.bfloat16)
        else:  # per row block, so float32 exists for a slice only
            tensor = torch.empty(size, dtype=torch.bfloat16)
            rows = tensor.view(size[0], -1)
            for start in range(0, size[0], 4096):
                rows[start:start + 4096] = torch.randn(rows[start:start + 4096].shape,
                                                       generator=generator).mul_(0.02)
        nbytes = tensor.numel() * 2
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
        shard[name], shard_bytes = tensor, shard_bytes + nbytes
    flush()
    renamed = {old: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, old in enumerate(shards)}
    for old, new in renamed.items():
        os.replace(folder / old, folder / new)
    total = sum(size.numel() * 2 for size in tensors.values())
    weight_map = {k: renamed[v] for k, v in index.items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(folder)
    generation = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    generation.save_pretrained(folder)
    word_tokenizer(config.vocab_size).save_pretrained(folder)
    (folder / _DONE).write_text(json.dumps({"shape": shape, "seed": seed, "parameters": total // 2}))
    return folder


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with one word per id (no download; the engine needs one, not a good one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def run_export(model: Path, out: Path, weights: str, dtype: str, rss_limit: int, timeout: float,
               extra: list[str], kv_calibration: str = "none") -> dict:
    """``popcompile export`` in a child process (its own process group), watched: the row of this run."""
    import psutil

    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "popcompile.cli", "export", str(model), "--out", str(out),
               "--weights", weights, "--dtype", dtype, "--kv-calibration", kv_calibration,
               "--min-prompt-tokens", "0", "--prune-ratio", "1/3", "--json", *extra]
    log = out.with_name(out.name + ".stderr.log")
    started, sampled, ended, peak = time.perf_counter(), 0, "ok", 0
    with open(log, "w") as err:
        child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                 start_new_session=True)
    watched, chunks = psutil.Process(child.pid), []
    reader = threading.Thread(target=lambda: chunks.append(child.stdout.read()), daemon=True)
    reader.start()
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)  # reaped here: its own rusage, not Popen's
        if pid:
            child.returncode, peak = os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024
            break
        try:
            rss = sum(p.memory_info().rss for p in [watched, *watched.children(recursive=True)])
        except psutil.Error:
            rss = 0
        sampled = max(sampled, rss)
        if ended == "ok" and (rss > rss_limit or time.perf_counter() - started > timeout):
            ended = (f"killed: RSS {rss / GIB:.1f} GiB > {rss_limit / GIB:.1f} GiB" if rss > rss_limit
                     else f"killed: past {timeout:.0f} s")
            os.killpg(child.pid, signal.SIGKILL)
        time.sleep(0.2)
    reader.join(timeout=10)
    wall = time.perf_counter() - started
    stderr = log.read_text(errors="replace")
    if ended == "ok" and child.returncode != 0:
        ended = f"failed: exit {child.returncode}"
    report = {}
    try:
        report = json.loads("".join(chunks)) if ended == "ok" else {}
    except ValueError:
        ended = "failed: no JSON on stdout"
    steps = report.get("steps") or [json.loads(line[5:]) for line in stderr.splitlines()
                                     if line.startswith("step {")]
    return {"status": ended, "peak_rss_gib": round(max(peak, sampled) / GIB, 2),
            "sampled_peak_rss_gib": round(sampled / GIB, 2), "wall_s": round(wall, 1),
            "engine_bytes": folder_bytes(out) if ended == "ok" else None, "steps": steps,
            "kv_fit": report.get("extra", {}).get("kv_fit"),
            "stderr_tail": None if ended == "ok" else stderr.strip().splitlines()[-3:],
            "command": " ".join(command[1:])}


def machine() -> dict:
    import psutil

    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "swap_gib": round(psutil.swap_memory().total / GIB, 1), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version()}


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, and per row the step with the highest peak."""
    lines = ["| shape | weights | dtype | K/V fit (estimate / took) | checkpoint | status | peak RSS | "
             "wall | engine folder | largest step (peak) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        top = max(row["steps"], key=lambda s: s["peak_rss_bytes"], default=None)
        largest = f"{top['name']} ({top['peak_rss_bytes'] / GIB:.1f} GiB)" if top else "-"
        engine = f"{row['engine_bytes'] / GIB:.2f} GiB" if row.get("engine_bytes") else "-"
        fit = row.get("kv_fit")
        fitted = row.get("kv_calibration", "none") + (
            f" ({fit['method']}: {fit['estimate_s']:.0f} s / {fit['elapsed_s']:.0f} s)" if fit else "")
        lines.append(f"| {row['shape']} | {row['weights']} | {row['dtype']} | {fitted} | "
                     f"{row['checkpoint_bytes'] / GIB:.2f} GiB | {row['status']} | "
                     f"{row['peak_rss_gib']:.1f} GiB | {row['wall_s']:.0f} s | {engine} | {largest} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), action="append",
                        help="model shape(s) to export (repeat for several)")
    parser.add_argument("--weights", choices=("float", "int8", "int4"), default="int4")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/popcompile-real-shapes"),
                        help="where the random checkpoints are written once and kept (bf16: 2.5/8/16 GB)")
    parser.add_argument("--engines-dir", type=Path, default=None,
                        help="where engines are exported (default MODELS_DIR/engines); each is replaced")
    parser.add_argument("--kv-calibration", default="none",
                        help="export's --kv-calibration (default none; ridge: the fit's estimate and time "
                             "are in the row's kv_fit)")
    parser.add_argument("--keep-engine", action="store_true", help="keep the engine folder after measuring")
    parser.add_argument("--rss-limit-gib", type=float, default=21.0,
                        help="kill the export above this resident memory (default 21)")
    parser.add_argument("--timeout", type=float, default=900.0, help="kill the export after this (s)")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoint(s), export nothing")
    parser.add_argument("--json", type=Path, help="append each row to this JSON-lines file")
    parser.add_argument("--table", type=Path, metavar="ROWS.jsonl",
                        help="print the rows of a --json file as a markdown table and exit")
    parser.add_argument("export_args", nargs="*", help="more `popcompile export` options (after --)")
    args = parser.parse_args(argv)
    if args.table:
        print(table([json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]))
        return 0
    if not args.shape:
        parser.error("give --shape (or --table)")
    engines = args.engines_dir or args.models_dir / "engines"
    engines.mkdir(parents=True, exist_ok=True)
    for shape in args.shape:
        started = time.perf_counter()
        folder = write_checkpoint(shape, args.models_dir / shape)
        print(f"{shape}: checkpoint {folder} ({folder_bytes(folder) / GIB:.2f} GiB, "
              f"{time.perf_counter() - started:.0f} s)", file=sys.stderr)
        if args.write_only:
            continue
        fit = "" if args.kv_calibration == "none" else f"-{args.kv_calibration}"
        out = engines / f"{shape}-{args.weights}-{args.dtype}{fit}"
        row = {"shape": shape, "weights": args.weights, "dtype": args.dtype,
               "kv_calibration": args.kv_calibration,
               "checkpoint_bytes": folder_bytes(folder),
               **run_export(folder, out, args.weights, args.dtype, int(args.rss_limit_gib * GIB),
                            args.timeout, args.export_args, args.kv_calibration),
               "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        print(json.dumps(row))
        if args.json:
            with open(args.json, "a") as handle:
                handle.write(json.dumps(row) + "\n")
        if not args.keep_engine:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
