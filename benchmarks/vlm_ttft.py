"""TTFT of POP vs full for image prompts on a vision-language ONNX engine, next to the FLOP bound of the cut
with the vision tower counted (popcompile.cost.vlm_speedup_bound).

Speed does not depend on the weights' values: the model is a random Qwen3-VL with Qwen3-VL-2B's widths
(text: hidden 2048, 16 heads of 128, 8 KV heads, MLP 6144; vision: hidden 1024, 16 heads, MLP 4096, patch
16, merge 2) and fewer layers so that a run fits this 2-core machine (default 6 text layers, cut 4: a
third pruned; 5 vision blocks, deepstack after vision blocks 0, 2, 4: depths 28:24 as in
Qwen3-VL-2B), and a 32k vocabulary (the LM head
runs on one position; the vocabulary only sizes the embedding table). Depth is scaled, not width, so the
vision tower's share of the work per token stays Qwen3-VL-2B's.

Square images (512 and 1024 pixels a side: 256 and 1024 image tokens; four of 1024 pixels, ``1024x4``:
4096 image tokens) and a 32-token question. One 2048-pixel image (16384 patches, 4096 tokens) does not fit
this machine's 24 GiB: the vision graph's attention runs as MatMul + Softmax on onnxruntime's CPU provider,
whose scores for one image are 16 heads x 16384^2 floats (17 GiB). Each image size runs in its own
process: the engine is loaded once, then POP and full run interleaved (pop, full, full, pop, ...), one new
token each; TTFT is from the call to the first token,
image preprocessing and the vision graph included (GenerationResult.ttft_s), and the text prefill alone is
reported beside it (ttft_s - image_s).

    python benchmarks/vlm_ttft.py --sizes 512 1024 1024x4 --reps 3 > vlm.md
    python benchmarks/vlm_ttft.py --text-layers 28 --vision-depth 24   # Qwen3-VL-2B's depth (hours here)
    python benchmarks/vlm_ttft.py --runtime torch --inner inductor      # torch.compile: "inductor" vs "pop"

``--runtime torch``: the same random model in PyTorch, its forward compiled twice with ``dynamic=True`` (the
inner backend alone, and backend "pop" over it; the dynamo flags of docs/torch_compile.md) with the vision
tower left to eager PyTorch (``torch.compiler.disable``, as docs/torch_compile.md says), one prefill call
with the images is the TTFT (``generate(..., max_new_tokens=1)``), vision tower included; the compile
(the first call) is excluded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CACHE = Path.home() / ".cache" / "popcompile" / "bench-engines"
QUESTION = 32
IDS = {"image_token_id": 32000, "video_token_id": 32001, "vision_start_token_id": 32002,
       "vision_end_token_id": 32003}


def config(text_layers: int, vision_depth: int):
    import transformers

    deepstack = list(range(0, vision_depth, 2))[:3]
    text = dict(vocab_size=32768, num_hidden_layers=text_layers, hidden_size=2048, intermediate_size=6144,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})
    vision = dict(depth=vision_depth, hidden_size=1024, intermediate_size=4096, num_heads=16,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
                  num_position_embeddings=2304, deepstack_visual_indexes=deepstack)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **IDS)


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(32000)}
    vocab.update({"<|image_pad|>": 32000, "<|video_pad|>": 32001, "<|vision_start|>": 32002,
                  "<|vision_end|>": 32003, "<unk>": 32004, "</s>": 32005})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>",
        additional_special_tokens=["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])


def engine(text_layers: int, vision_depth: int, cut: int) -> Path:
    folder = CACHE / f"qwen3vl-2b-widths-{text_layers}x{vision_depth}-cut{cut}"
    if (folder / "popcompile.json").exists():
        return folder
    import torch
    import transformers

    from popcompile.driver import export
    from popcompile.frontend.models import LoadedModel, ModelSource

    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config(text_layers, vision_depth)).eval()
    source = ModelSource(name="qwen3-vl-2b-widths (random)", kind="folder", path=str(folder) + "-source",
                         sha256=None)
    export(LoadedModel(model, tokenizer(), source), folder, cut=cut, kv_calibration="none",
           min_prompt_tokens=0, max_seq=4096 + QUESTION + 16)
    return folder


def parse_size(text: str) -> tuple[int, int]:
    """"SIDE" or "SIDExCOUNT": COUNT square images of SIDE pixels."""
    side, _, count = text.partition("x")
    return int(side), int(count or 1)


def worker(folder: Path, size: str, reps: int) -> dict:
    """One image size in this process: interleaved POP and full runs of one prompt."""
    import numpy as np
    from PIL import Image

    from popcompile.runtime import open_session

    side, count = parse_size(size)
    session = open_session(folder)
    rng = np.random.default_rng(side)
    images = [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(count)]
    prompt = " ".join(f"w{i}" for i in range(QUESTION))
    one = {"max_new_tokens": 1, "greedy": True}
    session.generate(prompt, one, images=images, chat=False)  # warm-up: arenas, kernels
    runs = {"pop": [], "full": []}
    for rep in range(reps):
        for mode in (("pop", "full") if rep % 2 == 0 else ("full", "pop")):
            result = session.generate(prompt, one, images=images, chat=False, mode=mode)[0]
            runs[mode].append({"ttft_s": result.ttft_s, "image_s": result.image_s})
    tokens = len(result.prompt_token_ids)
    patches = 4 * result.prompt_token_ids.count(IDS["image_token_id"]) // count
    return {"size": size, "images": count, "tokens": tokens, "patches": patches, "runs": runs}


def torch_worker(size: str, reps: int, text_layers: int, vision_depth: int, cut: int, inner: str) -> dict:
    """One image size with torch.compile: interleaved calls of the inner backend and of "pop" over it."""
    import time

    import numpy as np
    import torch
    import transformers
    from PIL import Image

    from popcompile.dynamo import PopBackend, PopOptions
    from popcompile.frontend.vision import image_processing
    from popcompile.runtime.vision import ImageProcessing, image_tokens, preprocess

    side, count = parse_size(size)
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config(text_layers, vision_depth)).eval()
    # the vision tower runs eager under both backends (docs/torch_compile.md: dynamo cannot trace its
    # attention's split by lengths.tolist() at these shapes); the text model, where POP acts, is compiled
    model.model.visual.forward = torch.compiler.disable(model.model.visual.forward)
    raw = image_processing(model.config, None)
    processing = ImageProcessing.from_dict(raw)
    rng = np.random.default_rng(side)
    done = [preprocess(Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)), processing)
            for _ in range(count)]
    ids = []
    for _, grid in done:
        ids += [IDS["vision_start_token_id"], *[IDS["image_token_id"]] * image_tokens(grid, 2),
                IDS["vision_end_token_id"]]
    ids = torch.tensor([ids + list(range(QUESTION))])
    inputs = {"input_ids": ids, "pixel_values": torch.tensor(np.concatenate([d[0] for d in done])),
              "image_grid_thw": torch.tensor([[1, *d[1]] for d in done]),
              "mm_token_type_ids": (ids == IDS["image_token_id"]).int(), "max_new_tokens": 1,
              "do_sample": False}
    backends = {"full": inner, "pop": PopBackend(PopOptions(cut=cut, inner=inner, min_prompt_tokens=0))}
    flags = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}
    runs = {"pop": [], "full": []}
    eager_forward = model.forward
    # generate() computes the M-RoPE index outside the forward (a Python loop over the images): the
    # compiled forward then holds the text model whole, as in tests/test_vlm_dynamo.py
    compiled = {mode: torch.compile(eager_forward, backend=backend, dynamic=True)
                for mode, backend in backends.items()}
    with torch.no_grad(), torch._dynamo.config.patch(**flags):
        for rep in range(reps + 1):  # rep 0 traces and compiles, untimed
            for mode in (("pop", "full") if rep % 2 == 0 else ("full", "pop")):
                model.forward = compiled[mode]
                start = time.perf_counter()
                model.generate(**inputs)
                if rep:
                    runs[mode].append({"ttft_s": time.perf_counter() - start, "image_s": 0.0})
    model.forward = eager_forward
    records = [r.kind for r in backends["pop"].records]
    assert "prefill-pop" in records, records  # the prefill was pruned, not a fallback
    return {"size": size, "images": count, "tokens": ids.shape[1], "patches": int(done[0][0].shape[0]),
            "runs": runs, "inner": inner}


def summarize(row: dict, model_config, cut: int) -> dict:
    from popcompile.cost import speedup_bound, vlm_speedup_bound

    median = {mode: statistics.median(r["ttft_s"] for r in runs) for mode, runs in row["runs"].items()}
    text = {mode: statistics.median(r["ttft_s"] - r["image_s"] for r in runs)
            for mode, runs in row["runs"].items()}
    vision = statistics.median(r["image_s"] for runs in row["runs"].values() for r in runs)
    bound = vlm_speedup_bound(model_config, row["tokens"], [row["patches"]] * row["images"], cut)
    text_bound = speedup_bound(model_config.text_config, row["tokens"], cut)
    ratio, text_ratio = median["full"] / median["pop"], text["full"] / text["pop"]
    return {**row, "full_s": median["full"], "pop_s": median["pop"], "vision_s": vision, "ratio": ratio,
            "bound": bound, "of_bound": ratio / bound, "text_full_s": text["full"], "text_pop_s": text["pop"],
            "text_ratio": text_ratio, "text_bound": text_bound, "text_of_bound": text_ratio / text_bound}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["512", "1024", "1024x4"],
                        help="image side in pixels, or SIDExCOUNT for COUNT such images")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--text-layers", type=int, default=6)
    parser.add_argument("--vision-depth", type=int, default=5)
    parser.add_argument("--cut", type=int, help="default: a third of the text layers pruned")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--runtime", choices=("onnxruntime", "torch"), default="onnxruntime")
    parser.add_argument("--inner", default="inductor", help="--runtime torch: the backend under pop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cut = args.cut or args.text_layers - args.text_layers // 3
    if args.worker and args.runtime == "torch":
        print(json.dumps(torch_worker(args.worker, args.reps, args.text_layers, args.vision_depth, cut,
                                      args.inner)))
        return
    folder = engine(args.text_layers, args.vision_depth, cut) if args.runtime == "onnxruntime" else None
    if args.worker:
        print(json.dumps(worker(folder, args.worker, args.reps)))
        return
    model_config = config(args.text_layers, args.vision_depth)
    rows = []
    for size in args.sizes:
        command = [sys.executable, __file__, "--worker", size, "--reps", str(args.reps), "--text-layers",
                   str(args.text_layers), "--vision-depth", str(args.vision_depth), "--cut", str(cut),
                   "--runtime", args.runtime, "--inner", args.inner]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode:
            print(f"{size}: the worker failed (exit {out.returncode}): {out.stderr.strip()[-300:]}",
                  file=sys.stderr)
            continue
        rows.append(summarize(json.loads(out.stdout.strip().splitlines()[-1]), model_config, cut))
        print(f"done {size}", file=sys.stderr, flush=True)
        if args.json:  # after each size: a later failure keeps what was measured
            args.json.write_text(json.dumps(rows, indent=2))
    where = "onnxruntime CPU" if args.runtime == "onnxruntime" else f"torch.compile ({args.inner} vs pop)"
    print(f"Qwen3-VL-2B widths, {args.text_layers} text layers (cut {cut}), {args.vision_depth} vision "
          f"blocks, {where} fp32, median of {args.reps}\n")
    print("| image | tokens | vision s | full TTFT s | POP TTFT s | full/POP | bound | of bound "
          "| text full/POP | text bound | of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        side, count = parse_size(r["size"])
        text = f"{r['text_ratio']:.3f} | {r['text_bound']:.3f} | {r['text_of_bound']:.1%}"
        if "inner" in r:  # torch: the vision tower and the text prefill are one forward call
            text = f"(one call) | {r['text_bound']:.3f} | -"
        vision = "-" if "inner" in r else f"{r['vision_s']:.2f}"
        print(f"| {count} x {side}x{side} | {r['tokens']} | {vision} | {r['full_s']:.2f} | "
              f"{r['pop_s']:.2f} | {r['ratio']:.3f} | {r['bound']:.3f} | {r['of_bound']:.1%} | {text} |")


if __name__ == "__main__":
    main()
