"""Lossless codecs on real gradients (compressor none, LowDiff+): ratio and throughput per codec.

Gradients come from a few training steps of examples/tinygpt.py on the stdlib text; each codec encodes and
decodes the same bytes, round-robin over several rounds; medians are reported.

    python bench/studies/codecs.py            # writes bench/results/codecs.json and docs/measurements/codecs.md
    python bench/studies/codecs.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.tinygpt import GPT, StdlibText  # noqa: E402
from lowdiff._storage import codecs  # noqa: E402
from lowdiff._storage.format import tensor_bytes  # noqa: E402


def gradients(d_model: int, n_layer: int, steps: int) -> list[tuple[bytes, int, str]]:
    torch.manual_seed(0)
    model = GPT(vocab_size=256, n_layer=n_layer, n_head=4, d_model=d_model, block_size=128, dropout=0.0)
    data = StdlibText(max_bytes=500_000)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x, y = data.get_batch(8, 128, gen)
        _, loss = model(x, y)
        loss.backward()
        for dtype in (torch.float32, torch.bfloat16):
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).to(dtype)
            out.append((bytes(tensor_bytes(flat)), flat.element_size(), str(dtype).removeprefix("torch.")))
        opt.step()
        opt.zero_grad()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out-dir", default=None, help="where to write results (default: bench/results and docs)")
    args = ap.parse_args()
    d_model, n_layer, steps, rounds = (64, 1, 1, 1) if args.smoke else (256, 4, 3, args.rounds)
    grads = gradients(d_model, n_layer, steps)
    results = []
    for dtype in ("float32", "bfloat16"):
        samples = [(raw, isz) for raw, isz, dt in grads if dt == dtype]
        nbytes = sum(len(r) for r, _ in samples)
        per: dict[str, dict[str, list[float]]] = {c: {"enc": [], "dec": [], "ratio": []} for c in codecs.CODECS}
        for _ in range(rounds):
            for c in codecs.CODECS:  # round-robin: machine drift hits every codec alike
                enc_s = dec_s = 0.0
                stored = 0
                for raw, isz in samples:
                    t0 = time.perf_counter()
                    e = codecs.encode(c, raw, isz)
                    t1 = time.perf_counter()
                    d = codecs.decode(c, e, len(raw), "bench", isz)
                    t2 = time.perf_counter()
                    assert bytes(d) == raw
                    enc_s, dec_s, stored = enc_s + t1 - t0, dec_s + t2 - t1, stored + len(e)
                per[c]["enc"].append(nbytes / 1e6 / enc_s)
                per[c]["dec"].append(nbytes / 1e6 / dec_s)
                per[c]["ratio"].append(nbytes / stored)
        for c, v in per.items():
            results.append({"dtype": dtype, "codec": c, "ratio": statistics.median(v["ratio"]),
                            "encode_MB_s": statistics.median(v["enc"]), "decode_MB_s": statistics.median(v["dec"]),
                            "bytes": nbytes})
    model_desc = f"tinygpt d_model={d_model} n_layer={n_layer}, {steps} steps of real gradients, {rounds} rounds"
    lines = [f"# Codecs on real gradients\n\n{model_desc} (`python bench/studies/codecs.py`). Medians.\n",
             "| dtype | codec | ratio | encode MB/s | decode MB/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['codec']} | {r['ratio']:.3f} | {r['encode_MB_s']:.0f} | {r['decode_MB_s']:.0f} |"
              for r in results]
    out_json = Path(args.out_dir) / "codecs.json" if args.out_dir else ROOT / "bench/results/codecs.json"
    out_md = Path(args.out_dir) / "codecs.md" if args.out_dir else ROOT / "docs/measurements/codecs.md"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps({"setup": model_desc, "results": results}, indent=1))
    out_md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
