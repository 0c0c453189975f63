"""Helpers of bench/gpu/vllm/eightb_on_h200.sh: an 8B-class target with random weights through the
pipeline's own stages and server controller. Each subcommand is one step the script times and skips once
its result exists:

    build-target --out DIR --size 8b|tiny --dtype bfloat16|float32   # the random Llama target vLLM serves
    prefill --run-dir RUN --out JSON                    # a baseline server; every prepared row, max_tokens 1
    compare --a RUN --b RUN --label TEXT --tol 0.02 --out JSON   # hidden-state files, per layer
    stop RUN ...                                        # whatever vLLM serves those runs' ports
    collect --out DIR --work WORK [RUN ...]             # results and failing logs' tails
    report one|two --work WORK --out JSON [--target DIR]   # the phase's figures, a table and JSON

Nothing here builds a shell string: every child gets an argv list.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The dry run's stand-in for the 8B shape (bench/gpu/synthetic.py LLAMA_8B is the real one)
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 4096}
SHARD_BYTES = 4_900_000_000  # safetensors shards of at most ≈ 4.9 GB, as published checkpoints are cut
INIT_STD = 0.02  # transformers' initializer_range for Llama
# lm_head rows the tokenizer can decode: logits of standard deviation 4 (the final norm's output has RMS 1),
# a target about as peaked as a trained model's (top-1 probability ≈ 0.5) rather than the near-uniform one
# 0.02 gives (std 1.3 at hidden 4096), whose soft targets would leave the draft almost nothing to learn
LOGIT_STD = 4.0


# --------------------------------------------------------------------------- build-target

def tensor_plan(config) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every weight of LlamaForCausalLM, in the order they are written."""
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    plan: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (v, h), "normal")]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        plan += [(p + "input_layernorm.weight", (h,), "ones"),
                 (p + "self_attn.q_proj.weight", (q, h), "normal"),
                 (p + "self_attn.k_proj.weight", (kv, h), "normal"),
                 (p + "self_attn.v_proj.weight", (kv, h), "normal"),
                 (p + "self_attn.o_proj.weight", (h, q), "normal"),
                 (p + "post_attention_layernorm.weight", (h,), "ones"),
                 (p + "mlp.gate_proj.weight", (inter, h), "normal"),
                 (p + "mlp.up_proj.weight", (inter, h), "normal"),
                 (p + "mlp.down_proj.weight", (h, inter), "normal")]
    return plan + [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (v, h), "lm_head")]


def shard_plan(plan, itemsize: int, limit: int = SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...], str]]]:
    shards: list[list] = [[]]
    used = 0
    for entry in plan:
        n = itemsize
        for d in entry[1]:
            n *= d
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += n
    return shards


def cmd_build_target(a) -> int:
    out = Path(a.out)
    record = out / "eightb.json"
    if record.is_file():
        rec = json.loads(record.read_text())
        print(f"target cached at {out}: {rec['params'] / 1e9:.3g} B parameters, {rec['dtype']}, "
              f"{len(rec['files'])} file(s)")
        return 0
    import torch
    from safetensors.torch import save_file
    from synthetic import llama_config

    from pipeline.profile import DemoTargetSection
    from pipeline.stages.build_target import END_TOKEN_ID, build_tokenizer

    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_tokenizer(DemoTargetSection())  # the demo's byte-level BPE and chat template, vocab 2048
    tok.save_pretrained(tmp)
    config = llama_config(**(TINY if a.size == "tiny" else {}))
    config.eos_token_id = [2, END_TOKEN_ID]  # <|eos|> and the chat template's <|end|>, as the demo target
    config.architectures = ["LlamaForCausalLM"]
    dtype = getattr(torch, a.dtype)
    config.dtype = dtype
    config.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, END_TOKEN_ID], "pad_token_id": 0, "do_sample": False}, indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(a.seed)
    known = len(tok)  # ids the tokenizer can decode; the model's vocabulary stays config.vocab_size
    shards = shard_plan(tensor_plan(config), torch.empty((), dtype=dtype).element_size())
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total, params = {}, 0, 0
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=2) as pool:  # the next shard is drawn while one is written
        pending = []
        for name, shard in zip(names, shards, strict=True):
            tensors = {}
            for key, shape, init in shard:
                t = torch.empty(shape, dtype=dtype, device=device)
                if init == "ones":
                    t.fill_(1.0)
                elif init == "lm_head":
                    # Decodable rows: logits N(0, LOGIT_STD²); the rows the tokenizer cannot decode give logit
                    # 0, below the decodable maximum (≈ 3.5 standard deviations) with certainty: greedy output
                    # stays inside the 2048 decodable ids, hence inside the draft vocabulary.
                    t.zero_()
                    t[:known].normal_(0.0, LOGIT_STD / config.hidden_size ** 0.5, generator=gen)
                else:
                    t.normal_(0.0, INIT_STD, generator=gen)
                tensors[key] = t.cpu()
                weight_map[key] = name
                total += t.numel() * t.element_size()
                params += t.numel()
                del t
            pending.append(pool.submit(save_file, tensors, str(tmp / name), {"format": "pt"}))
            if len(pending) > 1:
                pending.pop(0).result()
        for fut in pending:
            fut.result()
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    rec = {"size": a.size, "params": params, "bytes": total, "dtype": a.dtype, "files": names, "device": device,
           "init_std": INIT_STD, "lm_head_logit_std": LOGIT_STD,
           "lm_head_rows_zeroed_from": known if config.vocab_size > known else None,
           "vocab_size": config.vocab_size, "tokenizer_vocab": known, "seconds": round(time.perf_counter() - t0, 1)}
    (tmp / "eightb.json").write_text(json.dumps(rec, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"target built at {out} on {device} in {rec['seconds']} s: {params / 1e9:.3g} B parameters, {a.dtype}, "
          f"{len(names)} file(s), {total / 1e9:.2f} GB; tokenizer {known} ids, model vocabulary {config.vocab_size}")
    return 0


# --------------------------------------------------------------------------- prefill

def _metric_sum(text: str, name: str) -> float:
    """A counter of /metrics summed over its label sets (engines); prometheus adds "_total" to its name."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)", line)
        if m and m.group(1) in (name, name + "_total"):
            total += float(m.group(3))
    return total


def _metrics(base_url: str) -> dict:
    from pipeline.host.httpio import get as http_get
    code, text = http_get(f"{base_url}/metrics", timeout=10)
    if code != 200:
        return {}
    return {"prompt_tokens": _metric_sum(text, "vllm:prompt_tokens"),
            "prefix_cache_hits": _metric_sum(text, "vllm:prefix_cache_hits"),
            "prefix_cache_queries": _metric_sum(text, "vllm:prefix_cache_queries")}


def _complete(base_url: str, body: dict) -> dict:
    import urllib.request
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as resp:  # noqa: S310 - the loopback server we started
        return json.loads(resp.read())


def cmd_prefill(a) -> int:
    """Every prepared row of the run as a prompt (its token ids, max_tokens 1, greedy) against a plain
    (baseline-mode) server of the run's target, `extract.concurrency` requests in flight: the prefill the
    extraction server does, without the hidden states. The server is started on the run's port by the
    pipeline's own controller exactly as `eagle3-console server start --run-dir RUN --mode baseline` does,
    and left running: deploy-measure reuses it (same argv) for its baseline row. Each request carries its
    own cache_salt, so rows sharing a prefix (one row per assistant turn) are computed in full, as on the
    extraction server, which runs with prefix caching off."""
    import urllib.error
    from concurrent.futures import ThreadPoolExecutor

    from datasets import load_from_disk

    from pipeline.layout.rundir import RunDir
    from pipeline.serving import ports

    run = RunDir.open(Path(a.run_dir))
    profile = run.profile()
    target_dir, mode_args = ports.mode_inputs(profile, run, "baseline")
    t0 = time.perf_counter()
    rec = ports.start_mode(profile, "baseline", target_dir, log_path=run.log_path("server-baseline"),
                           say=lambda m: print(m[:300], flush=True), **mode_args)
    start_s = round(time.perf_counter() - t0, 1)
    print(f"baseline server healthy after {start_s} s: pid {rec.pid}, {rec.base_url}", flush=True)
    status = ports.controller(profile).status()
    rows = load_from_disk(str(run.prepared_dir)).with_format(None)["input_ids"]
    concurrency = a.concurrency or profile.extract.concurrency
    model = profile.server.served_model_name
    nonce = f"{os.getpid()}-{time.time_ns()}"
    body = {"model": model, "prompt": rows[0], "max_tokens": 1, "temperature": 0.0}
    salted = True
    try:  # warm-up, and whether this vLLM takes cache_salt
        _complete(rec.base_url, {**body, "cache_salt": f"warmup-{nonce}"})
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        if exc.code != 400:
            sys.exit(f"warm-up request failed: HTTP {exc.code}: {detail}")
        print(f"this vLLM refuses cache_salt ({detail}); measuring with prefix caching as served", flush=True)
        salted = False
        _complete(rec.base_url, body)

    def one(item):
        i, ids = item
        req = {**body, "prompt": ids}
        if salted:
            req["cache_salt"] = f"{nonce}-{i}"
        return _complete(rec.base_url, req)["usage"]["prompt_tokens"]

    before = _metrics(rec.base_url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        served = list(pool.map(one, enumerate(rows)))
    seconds = time.perf_counter() - t0
    after = _metrics(rec.base_url)
    tokens = sum(len(r) for r in rows)
    result = {"rows": len(rows), "tokens": tokens, "served_prompt_tokens": sum(served), "seconds": round(seconds, 3),
              "tokens_per_s": round(tokens / seconds, 1), "rows_per_s": round(len(rows) / seconds, 2),
              "concurrency": concurrency, "cache_salt": salted, "server_mode": rec.mode, "server_pid": rec.pid,
              "server_start_s": start_s, "server_uptime_s": status.get("uptime_s"),
              "tensor_parallel_size": profile.server.tensor_parallel_size}
    if before and after:
        result.update({k + "_delta": round(after[k] - before[k]) for k in after})
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"bare prefill: {len(rows)} rows, {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s at "
          f"concurrency {concurrency} (cache_salt {'on' if salted else 'refused'}; prefix-cache hits "
          f"{result.get('prefix_cache_hits_delta', '?')} tokens)")
    return 0


# --------------------------------------------------------------------------- compare

def cmd_compare(a) -> int:
    """Every hs_i of run A against run B's: identical token ids, and per layer id max |Δ|, max |x| (A),
    the relative figure max|Δ| / max|x| (also the worst single file's), mean |Δ|; the verdict holds when
    every layer's relative figure is within --tol."""
    import torch
    from safetensors.torch import load_file

    from pipeline.layout.rundir import RunDir

    ra, rb = RunDir.open(Path(a.a)), RunDir.open(Path(a.b))
    layer_ids = ra.stage_state("extract").get("figures", {}).get("layer_ids") or []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    files = sorted(ra.hidden_states_dir.glob("hs_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    n = None
    max_abs = max_x = sum_abs = worst_file_rel = None
    count, missing, token_mismatch, shape_mismatch = 0, [], [], []
    for f in files:
        other = rb.hidden_states_dir / f.name
        if not other.is_file():
            missing.append(f.name)
            continue
        x, y = load_file(str(f)), load_file(str(other))
        if not torch.equal(x["token_ids"], y["token_ids"]):
            token_mismatch.append(f.name)
            continue
        if x["hidden_states"].shape != y["hidden_states"].shape:  # e.g. a TP rank's share of the layers only
            shape_mismatch.append(f"{f.name}: {list(x['hidden_states'].shape)} vs {list(y['hidden_states'].shape)}")
            continue
        hx = x["hidden_states"].to(dev).float()
        hy = y["hidden_states"].to(dev).float()
        d = (hx - hy).abs()
        file_abs, file_x = d.amax(dim=(0, 2)), hx.abs().amax(dim=(0, 2))
        if n is None:
            n = file_abs.numel()
            max_abs, max_x = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
            sum_abs, worst_file_rel = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        max_abs = torch.maximum(max_abs, file_abs)
        max_x = torch.maximum(max_x, file_x)
        worst_file_rel = torch.maximum(worst_file_rel, file_abs / file_x.clamp_min(1e-12))
        sum_abs += d.sum(dim=(0, 2)) / (d.shape[0] * d.shape[2])
        count += 1
    result: dict = {"label": a.label, "a": str(ra.root), "b": str(rb.root), "files_compared": count,
                    "files_in_a": len(files), "missing_in_b": len(missing), "token_ids_differ": len(token_mismatch),
                    "shapes_differ": len(shape_mismatch), "first_shape_difference": shape_mismatch[:1],
                    "tolerance": f"max|Δ| <= {a.tol} * max|x| per layer id (x: {ra.root.name})", "tol": a.tol}
    if count:
        rel = (max_abs / max_x.clamp_min(1e-12)).tolist()
        ids = layer_ids if len(layer_ids) == n else list(range(n))
        result["layers"] = [{"layer_id": i, "max_abs_diff": ma, "max_abs_x": mx, "max_rel_diff": r,
                             "worst_file_rel_diff": w, "mean_abs_diff": s / count}
                            for i, ma, mx, r, w, s in zip(ids, max_abs.tolist(), max_x.tolist(), rel,
                                                          worst_file_rel.tolist(), sum_abs.tolist(), strict=True)]
        result["within_tolerance"] = (bool(all(r <= a.tol for r in rel)) and not missing and not token_mismatch
                                      and not shape_mismatch)
    else:
        result["within_tolerance"] = False
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(format_compare(result))
    return 0


def format_compare(c: dict) -> str:
    head = (f"{c['label']}: {c['files_compared']}/{c['files_in_a']} files, token ids differ in "
            f"{c['token_ids_differ']}, shapes in {c.get('shapes_differ', 0)} {c.get('first_shape_difference') or ''}, "
            f"missing {c['missing_in_b']}; tolerance {c['tolerance']}")
    lines = [head, f"  {'layer id':>8} {'max|Δ|':>10} {'max|x|':>10} {'max|Δ|/max|x|':>14} {'worst file':>11} "
                   f"{'mean|Δ|':>10}"]
    for r in c.get("layers", []):
        lines.append(f"  {r['layer_id']:>8} {r['max_abs_diff']:>10.3e} {r['max_abs_x']:>10.3e} "
                     f"{r['max_rel_diff']:>14.3e} {r['worst_file_rel_diff']:>11.3e} {r['mean_abs_diff']:>10.3e}")
    lines.append(f"  verdict: {'within' if c['within_tolerance'] else 'NOT within'} tolerance")
    return "\n".join(lines)


# --------------------------------------------------------------------------- stop / collect

def cmd_stop(a) -> int:
    """Stop, through the pipeline's own controller, whatever vLLM serves each run's port."""
    from pipeline.layout.rundir import RunDir
    from pipeline.serving import ports

    for r in a.runs:
        if not (Path(r) / "profile.toml").is_file():
            continue
        profile = RunDir.open(Path(r)).profile()
        try:
            stopped = ports.stop_server_on_port(profile, lambda m: print(f"  {m}"), force=True)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next port
            print(f"  port {profile.server.port}: {type(exc).__name__}: {exc}")
            continue
        if stopped:
            print(f"  stopped the vLLM server on port {profile.server.port} ({Path(r).name})")
    return 0


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""


def cmd_collect(a) -> int:
    """Into OUT: each run's state.json, preflight.json and eval/*.json, and the last 40 lines of every
    log of a stage that did not finish (with the server logs); the work directory's comparison JSONs
    and step outputs; the target's build record."""
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(work.glob("*.json")):
        shutil.copy2(f, out / f.name)
    steps = out / "steps"
    for f in sorted((work / "logs").glob("*.out")):
        steps.mkdir(exist_ok=True)
        (steps / f"{f.stem}.tail.txt").write_text(_tail(f, 60))
    if a.target and (Path(a.target) / "eightb.json").is_file():
        shutil.copy2(Path(a.target) / "eightb.json", out / "target-eightb.json")
    for r in map(Path, a.runs):
        if not (r / "state.json").is_file():
            continue
        dest = out / r.name
        dest.mkdir(exist_ok=True)
        for f in [r / "state.json", r / "preflight.json", *sorted((r / "eval").glob("*.json"))]:
            if f.is_file():
                shutil.copy2(f, dest / f.name)
        state = json.loads((r / "state.json").read_text())
        bad = [s for s, e in state.get("stages", {}).items() if e.get("status") not in ("done", None)]
        if bad:
            logs = dest / "logs"
            logs.mkdir(exist_ok=True)
            for s in bad:
                (logs / f"{s}.log.tail40").write_text(_tail(r / "logs" / f"{s}.log"))
            for f in sorted((r / "logs").glob("server-*.log")):
                (logs / f"{f.name}.tail40").write_text(_tail(f))
    print(f"results copied to {out}")
    return 0


# --------------------------------------------------------------------------- report

def _state(run: Path) -> dict:
    try:
        return json.loads((run / "state.json").read_text()).get("stages", {})
    except (OSError, ValueError):
        return {}


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _requests_seconds(run: Path) -> float | None:
    """speculators generate-offline-data's own "Timing: X s elapsed" (its requests, without its CLI start)."""
    try:
        text = (run / "logs" / "extract.log").read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"Timing: ([0-9.]+)s elapsed", text)
    return float(found[-1]) if found else None


def _rate(tokens, seconds) -> float | None:
    return round(tokens / seconds, 1) if tokens and seconds else None


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def _fmt(v, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def vllm_extraction(run: Path) -> dict:
    e = _state(run).get("extract", {})
    f = e.get("figures") or {}
    if e.get("status") != "done" or f.get("backend") != "vllm":
        return {}
    req = _requests_seconds(run)
    return {"tokens": f["tokens"], "samples": f["samples"], "seconds": f["seconds"],
            "tokens_per_s": _rate(f["tokens"], f["seconds"]), "server_start_s": f.get("server_start_s"),
            "requests_seconds": req, "requests_tokens_per_s": _rate(f["tokens"], req),
            "stage_seconds": e.get("seconds"), "layer_ids": f.get("layer_ids")}


def matrix_rows(online: dict | None) -> list[dict]:
    rows = []
    for method, row in (online or {}).get("matrix", {}).items():
        if row.get("error") and not row.get("levels"):
            rows.append({"method": method, "error": row["error"][:300]})
            continue
        for c, lv in sorted(row.get("levels", {}).items(), key=lambda kv: int(kv[0])):
            rows.append({"method": method, "concurrency": int(c), "output_tok_s": lv.get("output_tok_s"),
                         "tpot_ms": lv.get("tpot_ms"), "mean_acceptance_length": lv.get("mean_acceptance_length"),
                         "acceptance_per_position": lv.get("acceptance_per_position"),
                         "tokens_per_step": lv.get("tokens_per_step"), "speedup": lv.get("speedup"),
                         "identical_outputs": row.get("identical_outputs") if method != "baseline" else None,
                         "server_start_s": row.get("server_start_s"), "error": row.get("error")})
    return rows


def print_matrix(rows: list[dict]) -> None:
    print(f"  {'method':<9}{'c':>4}{'tok/s':>10}{'TPOT ms':>9}{'τ /metrics':>11}{'tok/step':>9}{'speedup':>8}"
          f"{'identical':>10}{'start s':>8}")
    for r in rows:
        if "concurrency" not in r:
            print(f"  {r['method']:<9} refused or failed: {r['error']}")
            continue
        ident = "" if r["identical_outputs"] is None else str(r["identical_outputs"])
        print(f"  {r['method']:<9}{r['concurrency']:>4}{_fmt(r['output_tok_s'], ',.1f'):>10}"
              f"{_fmt(r['tpot_ms'], '.2f'):>9}{_fmt(r['mean_acceptance_length'], '.3f'):>11}"
              f"{_fmt(r['tokens_per_step'], '.3f'):>9}{_fmt(r['speedup'], '.3f'):>8}{ident:>10}"
              f"{_fmt(r['server_start_s'], '.0f'):>8}")


def report_one(work: Path, target: Path | None = None) -> dict:
    main, tf = work / "runs" / "a-main", work / "runs" / "a-tf"
    st = _state(main)
    vl = vllm_extraction(main)
    t = _state(tf).get("extract", {})
    tff = t.get("figures") or {}
    hf = ({"tokens": tff.get("tokens"), "seconds": tff.get("seconds"), "tokens_per_s": tff.get("tokens_per_s"),
           "stage_seconds": t.get("seconds"), "batch_size": None} if t.get("status") == "done" else {})
    if hf:
        try:
            import tomllib
            prof = tomllib.loads((tf / "profile.toml").read_text())
            hf.update(batch_size=prof["extract"]["batch_size"], dtype=prof["target"]["dtype"])
        except (OSError, ValueError, KeyError):
            pass
    pre = _json(work / "a-prefill.json") or {}
    cmp_tf = _json(work / "a-compare-tf.json")
    train = st.get("train", {})
    ev = st.get("evaluate-offline", {})
    online = _json(main / "eval" / "online.json")
    offline = _json(main / "eval" / "offline.json")
    rep: dict = {"phase": "one", "run": str(main), "prepare": (st.get("prepare") or {}).get("figures"),
           "extraction": {"vllm": vl, "transformers": hf, "bare_prefill": pre,
                          "ratio_vllm_to_transformers": _ratio(vl.get("tokens_per_s"), hf.get("tokens_per_s")),
                          "ratio_vllm_to_bare_prefill": _ratio(vl.get("tokens_per_s"), pre.get("tokens_per_s")),
                          "ratio_vllm_requests_to_transformers": _ratio(vl.get("requests_tokens_per_s"),
                                                                        hf.get("tokens_per_s")),
                          "ratio_vllm_requests_to_bare_prefill": _ratio(vl.get("requests_tokens_per_s"),
                                                                        pre.get("tokens_per_s"))},
           "states_vllm_vs_transformers": cmp_tf,
           "train": {"status": train.get("status"), "seconds": train.get("seconds"),
                     "train_seconds": train.get("train_seconds"), **(train.get("figures") or {})},
           "evaluate_offline": {"status": ev.get("status"), "error": ev.get("error"),
                                **({k: offline[k] for k in ("tau", "acceptance_per_position", "lossless", "prompts")}
                                   if offline else {})},
           "matrix": {"status": (st.get("deploy-measure") or {}).get("status"),
                      "error": (st.get("deploy-measure") or {}).get("error"),
                      "decision": (online or {}).get("decision"), "rows": matrix_rows(online)},
           "stage_seconds": {k: v.get("seconds") for k, v in st.items()},
           "stage_status": {k: v.get("status") for k, v in st.items()}}
    x = rep["extraction"]
    p = rep["prepare"] or {}
    tgt = (_json(target / "eightb.json") if target else None) or {}
    if tgt:
        print(f"\n== target: {tgt['params'] / 1e9:.3g} B parameters ({tgt['size']}), {tgt['dtype']}, "
              f"{len(tgt['files'])} file(s), built on {tgt['device']} in {tgt['seconds']} s")
    print(f"\n== phase one: extraction of the same {p.get('rows', '?')} prepared rows ({_fmt(p.get('tokens'))} "
          f"tokens), layer ids {vl.get('layer_ids', '?')}")
    print(f"  {'what':<48}{'tokens/s':>10}{'seconds':>9}  note")
    print(f"  {'vLLM extraction (extract stage)':<48}{_fmt(vl.get('tokens_per_s')):>10}"
          f"{_fmt(vl.get('seconds'), '.2f'):>9}  generate-offline-data, its CLI start included; server start "
          f"{_fmt(vl.get('server_start_s'), '.0f')} s apart")
    print(f"  {'  the same, requests only':<48}{_fmt(vl.get('requests_tokens_per_s')):>10}"
          f"{_fmt(vl.get('requests_seconds'), '.2f'):>9}  speculators' own 'Timing: … elapsed' line")
    print(f"  {'transformers backend (extract stage)':<48}{_fmt(hf.get('tokens_per_s')):>10}"
          f"{_fmt(hf.get('seconds'), '.2f'):>9}  {hf.get('dtype', '?')}, batches of {hf.get('batch_size', '?')}; "
          f"stage {_fmt(hf.get('stage_seconds'), '.0f')} s with the model load")
    print(f"  {'bare vLLM prefill (baseline server, max_tokens 1)':<48}{_fmt(pre.get('tokens_per_s')):>10}"
          f"{_fmt(pre.get('seconds'), '.2f'):>9}  concurrency {pre.get('concurrency', '?')}, cache_salt "
          f"{pre.get('cache_salt', '?')}, prefix-cache hits {pre.get('prefix_cache_hits_delta', '?')} tokens; "
          f"server start {_fmt(pre.get('server_start_s'), '.0f')} s apart")
    print(f"  ratio vLLM extraction / transformers backend: {_fmt(x['ratio_vllm_to_transformers'], '.3f')} "
          f"(requests only: {_fmt(x['ratio_vllm_requests_to_transformers'], '.3f')})")
    print(f"  ratio vLLM extraction / bare prefill:         {_fmt(x['ratio_vllm_to_bare_prefill'], '.3f')} "
          f"(requests only: {_fmt(x['ratio_vllm_requests_to_bare_prefill'], '.3f')})")
    if cmp_tf:
        print("  " + format_compare(cmp_tf).replace("\n", "\n  "))
    tr = rep["train"]
    print(f"\n== phase one: train ({tr.get('status')}) and evaluate-offline ({rep['evaluate_offline'].get('status')})")
    print(f"  training tokens/s (median step) {_fmt(tr.get('tokens_per_s'))}, {tr.get('logged_steps', '?')} steps, "
          f"{tr.get('epochs', '?')} epoch(s), stage {_fmt(tr.get('seconds'), '.0f')} s (trainer "
          f"{_fmt(tr.get('train_seconds'), '.0f')} s), loss {tr.get('train_loss', '-')}")
    eo = rep["evaluate_offline"]
    print(f"  offline τ {eo.get('tau', '-')} (per position {eo.get('acceptance_per_position', '-')}), lossless "
          f"{eo.get('lossless', '-')}" + (f"; {eo['error']}" if eo.get("error") else ""))
    m = rep["matrix"]
    print(f"\n== phase one: benchmark matrix (deploy-measure {m['status']}), eval/online.json")
    print_matrix(m["rows"])
    base = next((r for r in m["rows"] if r.get("method") == "baseline"), None)
    if base and pre.get("server_start_s") is not None and (base.get("server_start_s") or 0) < 5:
        print(f"  (the baseline server was the bare prefill's, reused: its start took {pre['server_start_s']:.0f} s)")
    if m.get("decision"):
        print(f"  decision: {m['decision']}")
    if m.get("error"):
        print(f"  stage error: {m['error']}")
    got = {"(a) vLLM extraction tokens/s + server start": bool(vl),
           "(a) transformers backend tokens/s": bool(hf.get("tokens_per_s")),
           "(a) bare vLLM prefill tokens/s": bool(pre.get("tokens_per_s")),
           "(a) vLLM vs transformers states": bool(cmp_tf and cmp_tf.get("files_compared")),
           "training tokens/s": bool(tr.get("tokens_per_s")), "offline τ": "tau" in eo,
           "(b) matrix at every concurrency": bool(m["rows"]) and all("concurrency" in r for r in m["rows"])}
    rep["obtained"] = got
    return rep


def _train_side(train: dict, evaluate: dict) -> dict:
    f = train.get("figures") or {}
    return {"tokens_per_s": f.get("tokens_per_s"), "stage_seconds": train.get("seconds"),
            "train_seconds": train.get("train_seconds"), "epochs": f.get("epochs"), "train_loss": f.get("train_loss"),
            "tau": (evaluate.get("figures") or {}).get("tau"), "evaluate_status": evaluate.get("status"),
            "evaluate_error": evaluate.get("error")}


def report_two(work: Path) -> dict:
    main = work / "runs" / "a-main"
    tp2x, tp2s, onl = (work / "runs" / n for n in ("b-tp2-extract", "b-tp2-serve", "b-online"))
    v1, v2 = vllm_extraction(main), vllm_extraction(tp2x)
    cmp2 = _json(work / "b-compare-tp2.json")
    serve = _json(tp2s / "eval" / "online.json")
    sst, xst = _state(tp2s).get("deploy-measure", {}), _state(tp2x).get("extract", {})
    a_st, o_st = _state(main), _state(onl)
    o_train = o_st.get("train", {})
    of = o_train.get("figures") or {}
    tp = None
    try:
        import tomllib
        tp = tomllib.loads((tp2x / "profile.toml").read_text())["server"]["tensor_parallel_size"]
    except (OSError, ValueError, KeyError):
        pass
    offline = _train_side(a_st.get("train", {}), a_st.get("evaluate-offline", {}))
    online = _train_side(o_train, o_st.get("evaluate-offline", {}))
    server_events = [e for e in _events(onl) if e.get("stage") == "train" and e.get("kind") == "server"]
    online.update(generate_tok_s=of.get("generate_tok_s"), generated_tokens=of.get("generated_tokens"),
                  states_disk_peak_bytes=of.get("states_disk_peak_bytes"),
                  server_start_s=server_events[-1].get("start_s") if server_events else None)
    tp1_rows = [r for r in matrix_rows(_json(main / "eval" / "online.json"))
                if r.get("method") in ("baseline", "eagle3") and r.get("concurrency") in (1, 8)]
    x = {"tensor_parallel_size": tp, "status": xst.get("status"), "error": xst.get("error"), "tp1": v1, "tp2": v2,
         "compare": cmp2}
    s = {"status": sst.get("status"), "error": sst.get("error"), "decision": (serve or {}).get("decision"),
         "rows": matrix_rows(serve), "tp1_rows": tp1_rows}
    o = {"status": o_train.get("status"), "error": o_train.get("error"), "offline": offline, "online": online,
         "ratio_online_to_offline_tokens_per_s": _ratio(online["tokens_per_s"], offline["tokens_per_s"])}
    print(f"\n== phase two: extraction at TP {tp or '?'} vs phase one's TP 1 ({x['status']})"
          + (f": {x['error']}" if x.get("error") else ""))
    for label, v in (("TP 1", v1), (f"TP {tp or '?'}", v2)):
        print(f"  {label:<6} {_fmt(v.get('tokens_per_s'))} tok/s (requests only "
              f"{_fmt(v.get('requests_tokens_per_s'))}), server start {_fmt(v.get('server_start_s'), '.0f')} s")
    if cmp2:
        print("  " + format_compare(cmp2).replace("\n", "\n  "))
    print(f"\n== phase two: serving at TP {tp or '?'} (deploy-measure {s['status']})"
          + (f": {s['error']}" if s.get("error") else ""))
    print_matrix(s["rows"])
    if tp1_rows:
        print("  phase one's TP 1 rows at the same concurrency:")
        print_matrix(tp1_rows)
    print(f"\n== phase two: online training (serve GPU 0, train GPU 1) vs phase one's offline ({o['status']})"
          + (f": {o['error']}" if o.get("error") else ""))
    print(f"  {'':<34}{'offline':>12}{'online':>12}")
    for label, key in (("training tokens/s (median step)", "tokens_per_s"), ("train stage seconds", "stage_seconds"),
                       ("  of which the trainer", "train_seconds"), ("epochs", "epochs"),
                       ("final train loss", "train_loss"), ("offline τ of the head", "tau")):
        print(f"  {label:<34}{_fmt(offline.get(key), ',.4g'):>12}{_fmt(online.get(key), ',.4g'):>12}")
    print(f"  online: server start {_fmt(online['server_start_s'], '.0f')} s, generated "
          f"{_fmt(online['generated_tokens'])} tokens at {_fmt(online['generate_tok_s'])} tok/s, states on disk "
          f"peak {_fmt(online['states_disk_peak_bytes'])} B")
    print(f"  online / offline training tokens/s: {_fmt(o['ratio_online_to_offline_tokens_per_s'], '.3f')}")
    if online["evaluate_error"]:
        print(f"  online head's evaluate-offline: {online['evaluate_error']}")
    obtained = {"TP 2 extraction tokens/s": bool(v2), "TP 2 vs TP 1 states": bool(cmp2 and cmp2.get("files_compared")),
                "TP 2 serving matrix": bool(s["rows"]) and all("concurrency" in r for r in s["rows"]),
                "online training tokens/s": bool(online["tokens_per_s"]), "online head τ": online["tau"] is not None}
    return {"phase": "two", "tp_extraction": x, "tp_serving": s, "online_training": o, "obtained": obtained}


def _events(run: Path) -> list[dict]:
    out = []
    try:
        for line in (run / "events.jsonl").read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    except OSError:
        pass
    return out


def cmd_report(a) -> int:
    work = Path(a.work)
    rep = report_one(work, Path(a.target) if a.target else None) if a.phase == "one" else report_two(work)
    Path(a.out).write_text(json.dumps(rep, indent=2))
    print(f"\nfigures obtained (phase {a.phase}):")
    for what, ok in rep["obtained"].items():
        print(f"  {'yes' if ok else 'NO '}  {what}")
    missing = [w for w, ok in rep["obtained"].items() if not ok]
    print(f"phase {a.phase}: " + ("every figure obtained" if not missing else
                                  f"{len(missing)} figure(s) missing: call the phase again to resume what did not "
                                  f"finish, or read the logs under {work / 'logs'} and the runs' logs/"))
    print(f"written: {a.out}")
    return 0


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-target")
    b.add_argument("--out", required=True)
    b.add_argument("--size", choices=["8b", "tiny"], default="8b")
    b.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_build_target)
    p = sub.add_parser("prefill")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--concurrency", type=int, default=0, help="default: the run's extract.concurrency")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_prefill)
    m = sub.add_parser("compare")
    m.add_argument("--a", required=True)
    m.add_argument("--b", required=True)
    m.add_argument("--label", default="A vs B")
    m.add_argument("--tol", type=float, default=0.02)
    m.add_argument("--out", required=True)
    m.set_defaults(func=cmd_compare)
    s = sub.add_parser("stop")
    s.add_argument("runs", nargs="*")
    s.set_defaults(func=cmd_stop)
    k = sub.add_parser("collect")
    k.add_argument("--out", required=True)
    k.add_argument("--work", required=True)
    k.add_argument("--target", default="")
    k.add_argument("runs", nargs="*")
    k.set_defaults(func=cmd_collect)
    r = sub.add_parser("report")
    r.add_argument("phase", choices=["one", "two"])
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--target", default="")
    r.set_defaults(func=cmd_report)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
