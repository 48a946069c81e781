"""The ceiling the engine is compared with: a bare torch decoder with a static batch.

No paging, no scheduler, no per-step host work beyond one graph replay: a contiguous KV cache
[layers, batch, kv_heads, max_len, head_dim] (heads before positions, so that a window of it is
already in SDPA's [batch, heads, len, dim] layout), a batched prefill of all prompts (right
padding, causal SDPA), then greedy decode steps, each one CUDA graph that runs the whole
forward, the argmax, and the bookkeeping for the next step (next input token, position, output
slot) on the device. The host only picks the graph for the current attention window (cache
length rounded up to WINDOW), so a step never reads more than 255 positions past the longest
sequence. Every sequence in a batch steps until the longest one is done; only the tokens each
row asked for are counted.

It reads the weights of a Hugging Face directory (bench/random_model.py writes them), Llama
family or OPT, so it runs the same bytes as the engines it bounds. On a CPU it runs eagerly
(no graphs), which is how the tests check its tokens against transformers.

    python bench/bare_decoder.py MODEL_DIR --rows 400 --prompt-len 128 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from llmdb.engine.models.rope import frequencies, hf_divisors

WINDOW = 256  # attention windows (and the cache length) are multiples of this
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill chunk: bounds activation memory

# attend(layer, q [B,T,Hq,d], k [B,T,Hk,d], v [B,T,Hk,d]) -> [B, T, Hq*d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Config:
    arch: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_divisors: tuple[float, ...]  # one per rotary frequency (Llama 3's scaling), or ()
    tie: bool
    max_pos: int


def read_config(model_dir: Path) -> Config:
    c = json.loads((model_dir / "config.json").read_text())
    arch = {"llama": "llama", "opt": "opt"}.get(c.get("model_type"))
    if arch is None:
        raise ValueError(f"{model_dir}: the bare decoder runs llama and opt, not "
                         f"{c.get('model_type')!r}")
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    if arch == "opt" and c.get("word_embed_proj_dim", c["hidden_size"]) != c["hidden_size"]:
        raise ValueError("OPT with project_in/out (opt-350m) is not supported")
    return Config(
        arch=arch, vocab=c["vocab_size"], hidden=c["hidden_size"],
        layers=c["num_hidden_layers"], heads=heads,
        kv_heads=c.get("num_key_value_heads", heads),
        head_dim=head_dim,
        norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        # The engine's reading of the scaling entry, so both rotate by the same frequencies.
        rope_divisors=hf_divisors(c.get("rope_scaling") or rope, head_dim, theta,
                                  str(model_dir)) if arch == "llama" else (),
        tie=c.get("tie_word_embeddings", arch == "opt"),
        max_pos=c.get("max_position_embeddings", 2048),
    )


def read_weights(model_dir: Path, device: torch.device, dtype: torch.dtype
                 ) -> dict[str, torch.Tensor]:
    """All *.safetensors tensors, moved one at a time (host memory holds one shard)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors")
    out = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            out[k if k.startswith(("model.", "lm_head")) else f"model.{k}"] = v.to(device, dtype)
    return out


# ---- models ----------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32, as Hugging Face's LlamaRMSNorm does, then scaled in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout) in fp32; x [B,T,H,d], cos/sin [B,T,1,d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Llama:
    """GQA, RoPE, RMSNorm, SwiGLU; Q/K/V and gate/up fused into one matmul each."""

    def __init__(self, c: Config, w: dict[str, torch.Tensor], max_len: int):
        self.c = c
        self.embed = w.pop("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie else w.pop("lm_head.weight")
        self.norm = w.pop("model.norm.weight")
        self.layers = []
        for i in range(c.layers):
            p = f"model.layers.{i}."

            def take(n: str, p: str = p) -> torch.Tensor:
                return w.pop(p + n)

            self.layers.append((
                take("input_layernorm.weight"),
                torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"]),
                take("self_attn.o_proj.weight"),
                take("post_attention_layernorm.weight"),
                torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]),
                take("mlp.down_proj.weight"),
            ))
        d = c.head_dim
        inv_freq = torch.tensor(frequencies(d, c.rope_theta, c.rope_divisors),
                                dtype=torch.float64)
        angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        dev = self.embed.device
        self.cos, self.sin = angles.cos().float().to(dev), angles.sin().float().to(dev)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden] of tokens [B, T] at positions pos [B, T]."""
        c = self.c
        b, t = tokens.shape
        hq, hk, d = c.heads, c.kv_heads, c.head_dim
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        x = F.embedding(tokens, self.embed)
        for i, (ln1, qkv, o_w, ln2, gate_up, down) in enumerate(self.layers):
            q, k, v = F.linear(rms_norm(x, ln1, c.norm_eps), qkv).split(
                [hq * d, hk * d, hk * d], dim=-1)
            q = rope(q.view(b, t, hq, d), cos, sin)
            k = rope(k.view(b, t, hk, d), cos, sin)
            x = x + F.linear(attend(i, q, k, v.view(b, t, hk, d)), o_w)
            g, u = F.linear(rms_norm(x, ln2, c.norm_eps), gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, down)
        return rms_norm(x, self.norm, c.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


class OPT:
    """Pre-LN OPT: learned positions (offset 2), LayerNorm, MHA with biases, ReLU MLP."""

    def __init__(self, c: Config, w: dict[str, torch.Tensor], max_len: int):
        self.c = c
        p = "model.decoder."
        self.embed = w.pop(p + "embed_tokens.weight")
        self.positions = w.pop(p + "embed_positions.weight")
        self.lm_head = w.pop("lm_head.weight", self.embed)
        self.final_norm = (w.pop(p + "final_layer_norm.weight"),
                           w.pop(p + "final_layer_norm.bias"))
        self.layers = []
        for i in range(c.layers):
            q = f"{p}layers.{i}."

            def take(n: str, q: str = q) -> torch.Tensor:
                return w.pop(q + n)

            self.layers.append((
                take("self_attn_layer_norm.weight"), take("self_attn_layer_norm.bias"),
                torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"]),
                torch.cat([take(f"self_attn.{n}_proj.bias") for n in "qkv"]),
                take("self_attn.out_proj.weight"), take("self_attn.out_proj.bias"),
                take("final_layer_norm.weight"), take("final_layer_norm.bias"),
                take("fc1.weight"), take("fc1.bias"), take("fc2.weight"), take("fc2.bias"),
            ))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        c = self.c
        b, t = tokens.shape
        h, d, hs = c.heads, c.head_dim, (c.hidden,)
        x = F.embedding(tokens, self.embed) + F.embedding(pos + 2, self.positions)
        for i, (l1w, l1b, qkv_w, qkv_b, o_w, o_b, l2w, l2b, f1w, f1b, f2w, f2b) in enumerate(
                self.layers):
            q, k, v = F.linear(F.layer_norm(x, hs, l1w, l1b), qkv_w, qkv_b).chunk(3, dim=-1)
            o = attend(i, q.view(b, t, h, d), k.view(b, t, h, d), v.view(b, t, h, d))
            x = x + F.linear(o, o_w, o_b)
            x = x + F.linear(F.relu(F.linear(F.layer_norm(x, hs, l2w, l2b), f1w, f1b)), f2w, f2b)
        return F.layer_norm(x, hs, *self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


# ---- the decoder -----------------------------------------------------------------------------


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class BareDecoder:
    """One model, one KV cache sized for max_batch rows of max_len positions."""

    def __init__(self, model_dir: Path, max_batch: int, max_len: int, max_steps: int,
                 device: torch.device, dtype: torch.dtype):
        self.cfg = c = read_config(model_dir)
        self.device, self.dtype = device, dtype
        self.max_len = _round_up(max_len, WINDOW)
        if c.arch == "opt" and max_len > c.max_pos:
            raise ValueError(f"OPT has {c.max_pos} learned positions, {max_len} needed")
        w = read_weights(model_dir, device, dtype)
        self.model = (Llama if c.arch == "llama" else OPT)(c, w, self.max_len)
        shape = (c.layers, max_batch, c.kv_heads, self.max_len, c.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        # The decode step's state lives in these buffers, which the graphs read and update.
        z = {"device": device, "dtype": torch.long}
        self.tokens = torch.zeros(max_batch, **z)
        self.pos = torch.zeros(max_batch, **z)
        self.step = torch.zeros(1, **z)
        self.out = torch.zeros(max(max_steps, 4), max_batch, **z)
        self.arange = torch.arange(self.max_len, device=device)
        self.rows = torch.arange(max_batch, device=device)
        self.heads = torch.arange(c.kv_heads, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def kv_cache_mb(self) -> int:
        return (self.k_cache.nbytes + self.v_cache.nbytes) >> 20

    # -- prefill --

    def _prefill_attend(self, r0: int, t: int) -> Attend:
        """Writes the chunk's K/V at positions [0, t) of rows r0.. and attends causally.

        Right padding: a real token only sees earlier real tokens; what the pads write past
        a row's length is overwritten by its decode steps before any query reaches it."""
        g = self.cfg.heads // self.cfg.kv_heads

        def attend(i: int, q, k, v):
            b = q.shape[0]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, Hk, t, d]
            self.k_cache[i, r0 : r0 + b, :, :t] = k
            self.v_cache[i, r0 : r0 + b, :, :t] = v
            if g > 1:
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
            return o.transpose(1, 2).reshape(b, t, -1)

        return attend

    def prefill(self, prompts: list[list[int]]) -> None:
        """Fills the cache for rows 0..len(prompts)-1 and the first decode inputs."""
        lens = [len(p) for p in prompts]
        r0 = 0
        for chunk in _chunks(lens, PREFILL_TOKENS):
            b, t = len(chunk), max(lens[r0 : r0 + len(chunk)])
            ids = torch.zeros(b, t, dtype=torch.long)
            for j, p in enumerate(prompts[r0 : r0 + b]):
                ids[j, : len(p)] = torch.tensor(p)
            ids = ids.to(self.device, non_blocking=True)
            pos = self.arange[:t].expand(b, t)
            hidden = self.model.forward(ids, pos, self._prefill_attend(r0, t))
            last = torch.tensor([n - 1 for n in lens[r0 : r0 + b]], device=self.device)
            first = self.model.logits(hidden[torch.arange(b, device=self.device), last])
            self.tokens[r0 : r0 + b] = first.argmax(-1)
            r0 += b
        self.pos[: len(prompts)] = torch.tensor(lens, device=self.device)
        self.step.zero_()

    # -- decode --

    def _decode_attend(self, b: int, w: int) -> Attend:
        """Writes each row's new K/V at its position and attends over the first w positions.

        GQA without copying K/V: the g query heads of a KV head become g queries of that
        head, which all see the same keys, so no causal mask is needed among them."""
        c = self.cfg
        g = c.heads // c.kv_heads
        rows, heads, pos = self.rows[:b, None], self.heads[None, :], self.pos[:b, None]
        # 0 where a key position exists for the row, -inf past it: [b, 1, 1, w].
        mask = torch.zeros(b, w, device=self.device, dtype=self.dtype)
        mask.masked_fill_(self.arange[None, :w] > pos, float("-inf"))
        mask = mask[:, None, None, :]

        def attend(i: int, q, k, v):
            self.k_cache[i][rows, heads, pos] = k[:, 0]
            self.v_cache[i][rows, heads, pos] = v[:, 0]
            o = F.scaled_dot_product_attention(
                q.reshape(b, c.kv_heads, g, c.head_dim), self.k_cache[i, :b, :, :w],
                self.v_cache[i, :b, :, :w], attn_mask=mask)
            return o.reshape(b, 1, c.heads * c.head_dim)

        return attend

    def decode_step(self, b: int, w: int) -> None:
        """One greedy step for rows 0..b-1, all on the device (the graph's body)."""
        tokens, pos = self.tokens[:b], self.pos[:b]
        hidden = self.model.forward(tokens[:, None], pos[:, None], self._decode_attend(b, w))
        nxt = self.model.logits(hidden[:, 0]).argmax(-1)
        self.out[:, :b].index_copy_(0, self.step, nxt[None])
        tokens.copy_(nxt)
        pos.add_(1)
        self.step.add_(1)

    def capture(self, b: int, w: int) -> None:
        """Records decode_step(b, w) as a CUDA graph (after a warm-up on a side stream, which
        scribbles on the buffers and cache: capture before prefill, which resets them)."""
        if self.device.type != "cuda" or (b, w) in self.graphs:
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.pos.zero_()
        self.step.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.decode_step(b, w)
        torch.cuda.current_stream().wait_stream(side)
        self.step.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.decode_step(b, w)
        self.graphs[b, w] = graph

    def run_step(self, b: int, w: int) -> None:
        graph = self.graphs.get((b, w))
        if graph is None:
            self.decode_step(b, w)
        else:
            graph.replay()

    def windows(self, lens: list[int], max_tokens: int) -> list[int]:
        """The attention window of each decode step: the longest row's length, rounded up."""
        top = max(lens)
        return [_round_up(top + s + 1, WINDOW) for s in range(max_tokens - 1)]


def _chunks(lens: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows grouped so that rows x longest row <= budget (at least one row)."""
    out: list[list[int]] = []
    cur: list[int] = []
    for n in lens:
        if cur and (len(cur) + 1) * max(*cur, n) > budget:
            out.append(cur)
            cur = []
        cur.append(n)
    if cur:
        out.append(cur)
    return out


# ---- running a workload ----------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bare(model_dir: str | Path, prompts: list[list[int]], max_tokens: int | list[int],
             batch_size: int | None = None, *, device: str | None = None,
             dtype: torch.dtype | None = None, cuda_graphs: bool = True) -> dict:
    """Greedy-generates max_tokens (one int, or one per prompt) for every prompt, in static
    batches of batch_size rows (default: all at once); returns throughput and the tokens.

    gen_tok_per_s and prompt_tok_per_s divide by the whole run (prefill and decode), as the
    engines' figures do; graph capture and a warm-up prefill come before the clock starts.
    """
    t_start = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    wants = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(wants) != len(prompts) or min(wants) < 1 or min(map(len, prompts)) < 1:
        raise ValueError("need one max_tokens >= 1 per non-empty prompt")
    bs = batch_size or len(prompts)
    batches = [range(i, min(i + bs, len(prompts))) for i in range(0, len(prompts), bs)]
    # Every row of a batch steps until the batch's longest output is done.
    max_len = max(max(len(prompts[i]) for i in r) + max(wants[i] for i in r) for r in batches)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        dec = BareDecoder(Path(model_dir), min(bs, len(prompts)), max_len, max(wants), dev,
                          dtype)
        result = _timed_run(dec, prompts, wants, batches, cuda_graphs)
    result["startup_s"] = round(time.perf_counter() - t_start - result.pop("run_s"), 2)
    return result


def _timed_run(dec: BareDecoder, prompts: list[list[int]], wants: list[int],
               batches: list[range], cuda_graphs: bool) -> dict:
    """Captures the graphs and warms up (untimed), then runs every batch (timed)."""
    t_run = time.perf_counter()
    dev = dec.device

    t_cap = time.perf_counter()
    plans = []
    for rows in batches:
        lens, m = [len(prompts[i]) for i in rows], max(wants[i] for i in rows)
        plans.append((rows, m, dec.windows(lens, m)))
        if cuda_graphs:
            for w in sorted(set(plans[-1][2])):
                dec.capture(len(rows), w)
    # A warm-up prefill: cuBLAS and SDPA pick their kernels before the clock starts.
    first = [prompts[i] for i in batches[0]]
    dec.prefill(first[: max(1, len(first) // 4)])
    _sync(dev)
    capture_s = time.perf_counter() - t_cap

    outputs: list[list[int]] = [[] for _ in prompts]
    prefill_s = decode_s = 0.0
    steps = 0
    for rows, m, windows in plans:
        b = len(rows)
        t0 = time.perf_counter()
        dec.prefill([prompts[i] for i in rows])
        first_tokens = dec.tokens[:b].clone()
        _sync(dev)
        t1 = time.perf_counter()
        for w in windows:
            dec.run_step(b, w)
        _sync(dev)
        t2 = time.perf_counter()
        prefill_s, decode_s, steps = prefill_s + t1 - t0, decode_s + t2 - t1, steps + m - 1
        got = torch.cat([first_tokens[None], dec.out[: m - 1, :b]]).T.tolist()
        for j, i in enumerate(rows):
            outputs[i] = got[j][: wants[i]]
    elapsed = prefill_s + decode_s
    gen, prompt_tokens = sum(wants), sum(map(len, prompts))
    return {
        "engine": "bare",
        "rows": len(prompts),
        "gen_tok_per_s": round(gen / elapsed, 1),
        "prompt_tok_per_s": round(prompt_tokens / elapsed, 1),
        "ms_per_decode_step": round(1000 * decode_s / max(steps, 1), 3),
        "prefill_s": round(prefill_s, 3),
        "decode_s": round(decode_s, 3),
        "elapsed_s": round(elapsed, 3),
        "decode_steps": steps,
        "generated_tokens": gen,
        "prompt_tokens": prompt_tokens,
        "batch_size": len(batches[0]),
        "warmup_s": round(capture_s, 2),  # graph capture and a warm-up prefill
        "cuda_graphs": bool(dec.graphs),
        "num_graphs": len(dec.graphs),
        "kv_cache_mb": dec.kv_cache_mb,
        "peak_gpu_mem_mb": (torch.cuda.max_memory_allocated(dev) >> 20
                            if dev.type == "cuda" else None),
        "dtype": str(dec.dtype).removeprefix("torch."),
        "tokens": outputs,
        "run_s": time.perf_counter() - t_run,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (to compare)")
    args = ap.parse_args(argv)
    vocab = read_config(Path(args.model_dir)).vocab
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.rows)]
    res = run_bare(args.model_dir, prompts, args.max_tokens, args.batch_size, device=args.device,
                   cuda_graphs=not args.eager)
    res.pop("tokens")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
