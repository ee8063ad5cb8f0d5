"""summary.md: the figures of a run as one markdown table per part (a missing figure shows its error)."""

from __future__ import annotations

from bench.gpu import targets


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else (f"{v:,.0f}" if v >= 100 else f"{v:.3g}")


def _get(d: dict, *path, pct: bool = False) -> str:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return "-"
        if "error" in d and k not in d:
            return "error"
        d = d[k]
    return _fmt(d, pct) if isinstance(d, (int, float)) else "-"


def _adapters_at(decode: dict, n: int, rows_key: str) -> dict:
    """The decode item's figures for ``n`` adapters at the row count of ``rows_key`` (``rows_R``):
    ``adapters_N`` holds the first row count's, ``adapters_N_rows_R`` the others' (bench.gpu.sample)."""
    first = decode.get(f"adapters_{n}", {})
    if isinstance(first, dict) and f"rows_{first.get('rows')}" == rows_key:
        return first
    return decode.get(f"adapters_{n}_{rows_key}", {})


def _status(d: dict) -> str:
    if not isinstance(d, dict):
        return ""
    return "error: " + d["error"].splitlines()[0][:80] if "error" in d else d.get("skipped", "")


def _tenants(lo: dict, k: str) -> str:
    """Several tenants against one: the default's ratio, then each way the adapters can run."""
    paths = " / ".join(f"{p} {_get(lo, 'tenants', k, f'{p}_vs_one_tenant')}"
                       for p in ("dense", "grouped", "grouped_ops", "loop")
                       if f"{p}_vs_one_tenant" in lo.get("tenants", {}).get(k, {}))
    phases = lo.get("tenants", {}).get(k, {}).get("phases")
    synced = (f"; synced phases: forward/backward {_get(phases, 'forward_backward_ms')} ms, optimizer steps "
              f"{_get(phases, 'optimizer_steps_ms')} ms together ({_get(phases, 'optimizer_step_ms_per_unit')} a tenant), "
              f"{_get(phases, 'optimizer_steps_alone_ms')} ms one by one"
              if phases else "")
    t = lo.get("tenants", {}).get(k, {})
    # side by side with one tenant, step by step (bench.gpu.train.side_by_side): each pair's ratio
    # in order, so that a drift within the run shows as a trend
    paired = (f"; side by side {_fmt(t['vs_one_tenant_paired'])} (pairs " + "/".join(_fmt(r) for r in t.get("paired_ratios", []))
              + ")" if t.get("vs_one_tenant_paired") is not None else "")
    steps = ("; steps (ms): " + "/".join(f"{1e3 * s:.0f}" for s in t["steps_s"])) if t.get("steps_s") else ""
    return _get(lo, "tenants", k, "vs_one_tenant") + (f" ({paths})" if paths else "") + paired + steps + synced


def _four_by_eight(lo: dict) -> str:
    """The key of the four tenants of 8 rows each (1 row in a quick run)."""
    return next((k for k in lo.get("tenants", {}) if k.startswith("4x")), "4x8")


def _sft_curves(name: str, c: dict | None) -> list[str]:
    """One line for curves.py's item: how far each curve strayed from the fp32 plain run."""
    if not c:
        return []
    if "max_rel_dev" not in c:
        return [f"- {name}, SFT loss curves: {_status(c)}"]
    dev = c["max_rel_dev"]
    verdict = "yes" if c["within_bf16_noise"] else "no"
    return [f"- {name}, SFT loss curves ({c['steps']} steps of {c['rows']} docs paragraphs of at most {c['max_len']} "
            f"tokens, {c['dtype']}, lr {c['learning_rate']:g}; first / last step's loss {c['curves']['tinsmith'][0]:.4f} / "
            f"{c['curves']['tinsmith'][-1]:.4f}): largest relative straying from the fp32 plain run: tinsmith "
            f"{dev['tinsmith']:.2e}, among {c['tenants']} tenants {dev['tinsmith_tenants']:.2e}, plain "
            f"{dev['peft']:.2e}, tinsmith fp32 {dev['tinsmith_fp32']:.2e}; within bf16 noise: {verdict} "
            f"({c['worst_noise_ratio']:.2f}x the plain run's)"]


def _heading(title: str, header: str) -> list[str]:
    """A table's title, its header row and the separator, as many columns as the header names."""
    return [title, "", header, "|" + "---|" * (header.count("|") - 1)]


def _http(stack: dict | None) -> str:
    return "-" if not stack else f"{stack['http']} parser, {stack['loop']} loop"


def markdown(s: dict) -> str:
    pk = s["peak"]
    L = [f"# bench/gpu on {pk.get('device_name')} (torch {s['torch']}{', quick' if s['quick'] else ''})", "",
         f"Measured peaks: matmul {pk['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s, "
         f"copy {pk['copy_bytes_per_s'] / 1e9:.0f} GB/s (read + written). Wall {s.get('wall_s')} s. "
         f"glibc's allocator: {s.get('glibc_malloc', '-')}. Servers' HTTP: {_http(s.get('http_stack'))}.", ""]
    L += targets.markdown(s, _fmt)
    tr = s.get("train", {})
    if tr:
        L += _heading("## Training (tokens/s; MFU 4NT LoRA, 6NT full)",
                      "| shape | LoRA small | MFU | LoRA large | MFU | 4 tenants vs 1 | 4 tenants x 8 rows vs 1 | 16 tenants vs 1 | "
                      "packed tok/s | packed MFU | packed vs padded | long ctx (auto) tok/s; MFU 4NT / with attention | peft tok/s | "
                      "peft MFU | full FT MFU | peak GiB | training kernels vs torch (tok/s; peak GiB) | "
                      "LoRA nodes vs ops | loss softmax kernels vs torch | notes |")
        for name in s["shapes"]:
            lo, pf, ff = tr.get(f"{name}/lora", {}), tr.get(f"{name}/peft_baseline", {}), tr.get(f"{name}/full_finetune", {})
            keys = [k for k in lo if "x" in k and isinstance(lo[k], dict)]
            small, large = (keys + ["-", "-"])[:2]
            L.append(f"| {name} | {_get(lo, small, 'tokens_per_s')} | {_get(lo, small, 'mfu_4nt', pct=True)} | "
                     f"{_get(lo, large, 'tokens_per_s')} | {_get(lo, large, 'mfu_4nt', pct=True)} | "
                     f"{_tenants(lo, '4')} | {_tenants(lo, _four_by_eight(lo))} | {_tenants(lo, '16')} | "
                     f"{_get(lo, 'packing', 'packed', 'tokens_per_s')} | "
                     f"{_get(lo, 'packing', 'packed', 'mfu_4nt', pct=True)} | {_get(lo, 'packing', 'packed_vs_padded')} | "
                     f"{_get(lo, 'long_context', 'auto', 'tokens_per_s')}; "
                     f"{_get(lo, 'long_context', 'auto', 'mfu_4nt', pct=True)} / "
                     f"{_get(lo, 'long_context', 'auto', 'mfu_with_attention', pct=True)} | {_get(pf, 'tokens_per_s')} | "
                     f"{_get(pf, 'mfu_4nt', pct=True)} | {_get(ff, 'mfu_6nt', pct=True)} | {_get(lo, large, 'peak_gib')} | "
                     f"{_get(lo, 'torch_elementwise', 'kernels_vs_torch')}; {_get(lo, small, 'peak_gib')} vs "
                     f"{_get(lo, 'torch_elementwise', 'peak_gib')} | {_get(lo, 'lora_as_ops', 'nodes_vs_ops')} | "
                     f"{_get(lo, 'loss_softmax_in_torch', 'kernels_vs_torch')} | "
                     f"{'; '.join(x for x in (_status(lo), _status(pf), _status(ff)) if x)} |")
        L.append("")
        ab = tr.get("attention_backends", {})
        if ab:
            L += _heading(f"### Training's causal attention alone, forward + backward, {ab.get('heads', '-')} query heads over "
                          f"{ab.get('kv_heads', '-')} K/V heads of {ab.get('head_dim', '-')} (ms; TFLOP/s; share of the "
                          "matmul peak; first call ms, a new length's first call ms)",
                          "| tokens | way | ms | TFLOP/s | of peak | grouped heads | first call | new length | notes |")
            for ck in [k for k in ab if isinstance(ab[k], dict)]:
                for way, r in ab[ck].items():
                    if not isinstance(r, dict):
                        continue
                    L.append(f"| {ck} | {way} | {_get(r, 'ms')} | {_get(r, 'tflops')} | {_get(r, 'of_peak', pct=True)} | "
                             f"{r.get('grouped', '-')} | {_get(r, 'first_call_ms')} | {_get(r, 'new_length_first_call_ms')} | "
                             f"{r.get('error', '')} |")
                if "error" in ab[ck]:
                    L.append(f"| {ck} | - | - | - | - | - | - | - | {ab[ck]['error']} |")
            if _status(ab):
                L.append(f"| - | - | - | - | - | - | - | - | {_status(ab)} |")
            L.append("")
        for name in s["shapes"]:
            lo = tr.get(f"{name}/lora", {})
            if "cudnn_attention" in lo or "cudnn_vs_auto" in lo.get("long_context", {}):
                L.append(f"- {name}, cuDNN's attention first, whole LoRA steps: {lo.get('cudnn_attention', {}).get('shape', '-')} "
                         f"{_get(lo, 'cudnn_attention', 'tokens_per_s')} tok/s, "
                         f"{_get(lo, 'cudnn_attention', 'vs_default')}x the default's (first step "
                         f"{_get(lo, 'cudnn_attention', 'first_step_s')} s); 1 x "
                         f"{lo.get('long_context', {}).get('seq_len', '-')} (server defaults) "
                         f"{_get(lo, 'long_context', 'auto_cudnn', 'tokens_per_s')} tok/s, "
                         f"{_get(lo, 'long_context', 'cudnn_vs_auto')}x, MFU 4NT "
                         f"{_get(lo, 'long_context', 'auto_cudnn', 'mfu_4nt', pct=True)}")
        for name in s["shapes"]:
            lc = tr.get(f"{name}/lora", {}).get("long_context", {})
            if "auto_80gb" in lc:
                r = lc["auto_80gb"]
                within = (f"the allocator capped at {_get(r, 'memory_cap_gib')} GiB" if "memory_cap_gib" in r
                          else "the card itself (80 GB or less)")
                L.append(f"- {name}, 1 x {lc.get('seq_len', '-')} with no flags within an 80 GB card's memory ({within}): "
                         f"{_get(r, 'tokens_per_s')} tok/s, MFU 4NT {_get(r, 'mfu_4nt', pct=True)}, peak "
                         f"{_get(r, 'peak_gib')} GiB, micro-batches of {r.get('micro_batch_tokens', '-')} tokens"
                         f"{'; ' + r['error'] if 'error' in r else ''}")
        for name in s["shapes"]:
            L += _sft_curves(name, tr.get(f"{name}/sft_curves"))
        L.append("")
    L += _profiles(s)
    L += _copies(s)
    L += _allocator(s)
    sa = s.get("sample", {})
    if sa:
        L += _heading("## Sampling (tokens/s)",
                      "| shape | rows | tok/s | of HBM bound | of bound with prefill | of roofline with prefill "
                      "(bytes and FLOPs) | captures in timed run | "
                      "admitting s in timed run (8 / 64 adapters) | first run tok/s (graph captures) | "
                      "8 adapters vs base (by tiles; bytes bound) | "
                      "64 adapters vs base (by tiles; bytes bound) | HF generate tok/s | GRPO separate / num_samples | first call s | "
                      "second call s | notes |")
        for name in s["shapes"]:
            de, ge, sd = sa.get(f"{name}/decode", {}), sa.get(f"{name}/generate_baseline", {}), sa.get(f"{name}/sdk", {})
            for rk in [k for k in de if k.startswith("rows_")] or ["-"]:
                a8, a64 = (_adapters_at(de, n, rk) for n in (8, 64))
                L.append(f"| {name} | {rk[5:]} | {_get(de, rk, 'tokens_per_s')} | {_get(de, rk, 'of_hbm_bound', pct=True)} | "
                         f"{_get(de, rk, 'of_bound_with_prefill', pct=True)} | "
                         f"{_get(de, rk, 'of_roofline_with_prefill', pct=True)} | {_get(de, rk, 'captures_in_timed_run')} | "
                         f"{_get(de, rk, 'timed_run_stats', 'admitting_s')} ({_get(a8, 'timed_run_stats', 'admitting_s')}"
                         f" / {_get(a64, 'timed_run_stats', 'admitting_s')}) | "
                         f"{_get(de, rk, 'first_run_tokens_per_s')} | {_get(a8, 'vs_base')} ({_get(a8, 'segmented_vs_base')}; "
                         f"{_get(a8, 'bytes_bound_vs_base')}) | "
                         f"{_get(a64, 'vs_base')} ({_get(a64, 'segmented_vs_base')}; {_get(a64, 'bytes_bound_vs_base')}) | "
                         f"{_get(ge, 'tokens_per_s')} | "
                         f"{_get(sd, 'grpo', 'separate_vs_num_samples')} | {_get(sd, 'first_call_s')} | "
                         f"{_get(sd, 'second_call_s')} | {'; '.join(x for x in (_status(de), _status(ge), _status(sd)) if x)} |")
        L.append("")
        L += _heading("## Decode steps per host read-back (tokens/s, graphs on, base model; each burst queued "
                      "ahead of the last one's read, but for 'read first')",
                      "| shape | rows | 4 | 4, read first | ahead / read first | 8 | 16 | 16 vs 4 | 4 again | "
                      "scattered ends: ahead / read first | notes |")
        for name in s["shapes"]:
            db = sa.get(f"{name}/decode_bursts", {})
            for rk in [k for k in db if k.startswith("rows_")] or ["-"]:
                L.append(f"| {name} | {rk[5:]} | {_get(db, rk, 'burst_4')} | {_get(db, rk, 'burst_4_read_first')} | "
                         f"{_get(db, rk, 'ahead_vs_read_first')} | {_get(db, rk, 'burst_8')} | "
                         f"{_get(db, rk, 'burst_16')} | {_get(db, rk, 'burst_16_vs_4')} | "
                         f"{_get(db, rk, 'burst_4_again')} | {_get(db, rk, 'scattered_ahead_vs_read_first')} | "
                         f"{_status(db)} |")
        L.append("")
        for name in s["shapes"]:
            dl = sa.get(f"{name}/dependent_launches")
            if dl:
                on = "on" if dl.get("active") else f"off ({dl.get('off_reason')})"
                L.append(f"- {name}, {dl.get('rows', '-')} rows, Triton kernels launched dependent on the kernel "
                         f"before (programmatic dependent launch, {on}) vs as before: base model "
                         f"{_get(dl, 'base', 'on_vs_off')}x ({_get(dl, 'base', 'off_tokens_per_s')} tok/s off), "
                         f"8 adapters {_get(dl, 'adapters_8', 'on_vs_off')}x "
                         f"({_get(dl, 'adapters_8', 'off_tokens_per_s')} tok/s off) {_status(dl)}")
            ek = sa.get(f"{name}/expands_in_kernels")
            if ek:
                parts = "; ".join(
                    f"{n} adapters {_get(ek, f'adapters_{n}', 'on_vs_off')}x (without the norms' "
                    f"{_get(ek, f'adapters_{n}', 'without_norms_vs_off')}x, without the SiLU's shrink "
                    f"{_get(ek, f'adapters_{n}', 'without_silu_shrink_vs_off')}x; "
                    f"{_get(ek, f'adapters_{n}', 'off_tokens_per_s')} tok/s apart)" for n in (8, 64))
                L.append(f"- {name}, {ek.get('rows', '-')} rows, the adapters' expands (and the down shrink) "
                         f"taken by the kernels reading their outputs vs each its own launch: {parts} {_status(ek)}")
            sd = sa.get(f"{name}/decode_skinny")
            if sd:
                parts = "; ".join(f"{rk[5:]} rows {case} {_get(sd, rk, case, 'on_vs_off')}x "
                                  f"({_get(sd, rk, case, 'off_tokens_per_s')} tok/s on cuBLAS)"
                                  for rk in sd if rk.startswith("rows_") for case in sd[rk])
                failed = f" (the kernel failed: {sd['kernel_failed']})" if sd.get("kernel_failed") else ""
                apart = (f"; 8 adapters' shrinks in the products' launches vs each its own: "
                         f"{_get(sd, 'adapters_8_shrink_apart', 'shrink_in_product_vs_apart')}x")
                L.append(f"- {name}, the decode step's products through the skinny-product kernel vs cuBLAS: "
                         f"{parts}{apart}{failed} {_status(sd)}")
        L.append("")
        L += _heading("## Decode with CUDA graphs vs eager (tokens/s)",
                      "| shape | rows | adapters | eager | graphs | graphs / eager | captures in timed run | notes |")
        for name in s["shapes"]:
            cg = sa.get(f"{name}/cuda_graphs", {})
            for rk in [k for k in cg if k.startswith("rows_")] or ["-"]:
                rows, _, kind = rk[5:].partition("_")
                L.append(f"| {name} | {rows} | {kind} | {_get(cg, rk, 'eager_tokens_per_s')} | "
                         f"{_get(cg, rk, 'graphs_tokens_per_s')} | {_get(cg, rk, 'graphs_vs_eager')} | "
                         f"{_get(cg, rk, 'graph_captures')} | {_status(cg)} |")
        L.append("")
        L += _heading("### One layer's decode attention, rows of mixed lengths (us; share of copy bandwidth)",
                      "| shape | rows | SDPA at span | SDPA at capacity (graphs) | kernels at span | kernels at capacity | "
                      "kernels over pages | kernels vs SDPA at capacity | notes |")
        for name in s["shapes"]:
            da = sa.get(f"{name}/decode_attention", {})
            for rk in [k for k in da if k.startswith("rows_")]:
                cells = [f"{_get(da, rk, v, 'us')} ({_get(da, rk, v, 'of_copy_bw', pct=True)})"
                         for v in ("sdpa_span", "sdpa_capacity", "kernels_span", "kernels_capacity",
                                   "kernels_pages_capacity")]
                L.append(f"| {name} | {rk[5:]} | {' | '.join(cells)} | {_get(da, rk, 'kernels_vs_sdpa_capacity')} | "
                         f"{_status(da)} |")
        L.append("")
        L += _heading("### Through the SDK: GRPO's requests as the server counts them; sampling beside a training tenant",
                      "| shape | GRPO traffic | asample HTTP ms | queue wait ms | wait for a row ms | sampling step s | "
                      "prompt tokens computed | "
                      "prefills | graph captures | decode steps | sent s (first..last) | arrivals s (first..last) | last start s | "
                      "completions s | collector ms | CPU ms a request: client, server (its loop) | "
                      "ratio from the last arrival | notes |")
        for name, item in [(n, f"{n}/{k}") for n in s["shapes"] for k in ("sdk", "sdk_pyqwest")]:
            g = sa.get(item, {}).get("grpo", {})
            if not g:
                continue
            for kind in ("separate", "num_samples"):
                c, t, u = g.get(f"{kind}_server", {}), g.get(f"{kind}_timeline", {}), g.get(f"{kind}_cpu", {})
                ms = {k: (None if c.get(f"{k}_mean_s") is None else 1e3 * c[f"{k}_mean_s"])
                      for k in ("asample_http", "queue_wait", "admission_wait")}
                L.append(f"| {name}{' (pyqwest)' if item.endswith('pyqwest') else ''} | {kind} | {_fmt(ms['asample_http'])} | {_fmt(ms['queue_wait'])} | "
                         f"{_fmt(ms['admission_wait'])} | "
                         f"{_get(c, 'step_mean_s')} | {_get(c, 'prefill_tokens')} | {_get(c, 'prefills')} | "
                         f"{_get(c, 'graph_captures')} | {_get(c, 'decode_steps')} | "
                         f"{_get(t, 'first_send_s')}..{_get(t, 'last_send_s')} | "
                         f"{_get(t, 'first_arrival_s')}..{_get(t, 'last_arrival_s')} | {_get(t, 'last_start_s')} | "
                         f"{_get(t, 'first_completion_s')}..{_get(t, 'last_completion_s')} | "
                         f"{_fmt(None if c.get('gc_pause_s') is None else 1e3 * c['gc_pause_s'])} | "
                         f"{_get(u, 'client_ms_per_request')}, {_get(u, 'server_ms_per_request')} "
                         f"({_get(u, 'server_loop_ms_per_request')}) | "
                         f"{_get(g, 'separate_after_last_arrival_vs_num_samples') if kind == 'separate' else '-'} | |")
        L.append("")
        L.append("| shape | train tok/s alone (a step sent ahead) | vs in-process | a step through the SDK ms: the server's span (forward_backward "
                 "queue + run, optim_step wait + run); the rest | micro-batch tokens | with a sampling tenant | kept | "
                 "sample tok/s alone | with a training tenant | kept | notes |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for name in s["shapes"]:
            b = sa.get(f"{name}/beside_training")
            if b is None:
                continue
            st = b.get("train_alone_steps", {})
            inproc = s.get("train", {}).get(f"{name}/lora", {}).get(f"{st.get('rows', 8)}x{st.get('length', 1024)}", {})
            vs = (b["alone"]["train_tokens_per_s"] / inproc["tokens_per_s"]
                  if inproc.get("tokens_per_s") and b.get("alone", {}).get("train_tokens_per_s") else None)
            L.append(f"| {name} | {_get(b, 'alone', 'train_tokens_per_s')} ({_get(b, 'alone', 'train_ahead_tokens_per_s')}) | "
                     f"{_fmt(vs)} | {_get(st, 'step_ms')}: "
                     f"{_get(st, 'server_span_ms')} ({_get(st, 'forward_backward_queue_ms')} + "
                     f"{_get(st, 'forward_backward_run_ms')}, {_get(st, 'optim_step_wait_ms')} + "
                     f"{_get(st, 'optim_step_run_ms')}); {_get(st, 'rest_ms')} | {_get(st, 'micro_batch_tokens')} | "
                     f"{_get(b, 'together', 'train_tokens_per_s')} | "
                     f"{_get(b, 'train_kept')} | {_get(b, 'alone', 'sample_tokens_per_s')} | "
                     f"{_get(b, 'together', 'sample_tokens_per_s')} | {_get(b, 'sample_kept')} | {_status(b)} |")
        L.append("")
        L.append("| shape | rows x new tokens | light request ms | decode steps it waited | rows taken back | "
                 "busy tok/s alone | with it | kept | notes |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for name in s["shapes"]:
            f = sa.get(f"{name}/fair_share")
            if f is None:
                continue
            L.append(f"| {name} | {_get(f, 'rows')} x {_get(f, 'new_tokens')} | "
                     f"{_fmt(None if f.get('light_s') is None else 1e3 * f['light_s'])} | "
                     f"{_get(f, 'light_waited_steps')} | {_get(f, 'yielded_rows')} | {_get(f, 'busy_alone_tokens_per_s')} | "
                     f"{_get(f, 'busy_tokens_per_s')} | {_get(f, 'busy_kept')} | {_status(f)} |")
        L.append("")
        L += _heading("### K/V cache layout: per-row buffers vs pages (CUDA graphs on)",
                      "| shape | layout | tok/s (rows, standard) | mixed batch tok/s | mixed: most rows at once | notes |")
        for name in s["shapes"]:
            kv = sa.get(f"{name}/kv_layout", {})
            for layout in ("rows", "paged"):
                lay = kv.get(layout, {})
                standard = " / ".join(_get(lay, k) for k in lay if k.endswith("_tokens_per_s") and k.startswith("rows_"))
                L.append(f"| {name} | {layout} | {standard or '-'} | {_get(lay, 'mixed_tokens_per_s')} | "
                         f"{_get(lay, 'mixed_peak_rows')} | {_status(kv)} |")
        L.append("")
        L += _heading("### GRPO's separate requests in two waves: the second wave's prompts in the prefix cache",
                      "| shape | layout | prefix cache | second wave tok/s | its prompt tokens computed | "
                      "K/V MB held | notes |")
        for name in s["shapes"]:
            pw = sa.get(f"{name}/prefix_waves", {})
            for layout in ("rows", "paged"):
                for cache in ("on", "off"):
                    r = pw.get(f"{layout}/cache_{cache}", {})
                    L.append(f"| {name} | {layout} | {cache} | {_get(r, 'second_wave_tokens_per_s')} | "
                             f"{_get(r, 'second_wave_prompt_tokens_computed')} | {_get(r, 'kv_mbytes_held')} | "
                             f"{_status(pw)} |")
        L.append("")
        dr = sa.get("qwen3_5/delta_rule_step", {})
        L += _heading("### One Gated DeltaNet layer's decode step, Qwen3.5 shape (us; share of copy bandwidth)",
                      "| rows | state MB | torch (+ copy into rows) | fused, in place | fused vs torch | notes |")
        for rk in [k for k in dr if k.startswith("rows_")]:
            L.append(f"| {rk[5:]} | {_get(dr, rk, 'state_mbytes')} | {_get(dr, rk, 'torch', 'us')} "
                     f"({_get(dr, rk, 'torch', 'of_copy_bw', pct=True)}) | {_get(dr, rk, 'fused', 'us')} "
                     f"({_get(dr, rk, 'fused', 'of_copy_bw', pct=True)}) | {_get(dr, rk, 'fused_vs_torch')} | "
                     f"{_status(dr)} |")
        L.append("")
        tc = sa.get("token_choice", {})
        L += _heading("### One decode step's token choice, 151,936-entry vocabulary, bf16 logits (us; logits "
                      "read once as a share of copy bandwidth)",
                      "| rows | torch | one program a row | by segments | segments vs torch | segments vs one "
                      "program a row | same tokens | notes |")
        for rk in [k for k in tc if k.startswith("rows_")]:
            L.append(f"| {rk[5:]} | {_get(tc, rk, 'torch', 'us')} ({_get(tc, rk, 'torch', 'of_copy_bw', pct=True)}) | "
                     f"{_get(tc, rk, 'one_program_a_row', 'us')} "
                     f"({_get(tc, rk, 'one_program_a_row', 'of_copy_bw', pct=True)}) | "
                     f"{_get(tc, rk, 'kernel', 'us')} ({_get(tc, rk, 'kernel', 'of_copy_bw', pct=True)}) | "
                     f"{_get(tc, rk, 'kernel_vs_torch')} | {_get(tc, rk, 'kernel_vs_one_program_a_row')} | "
                     f"{tc[rk].get('same_tokens', '-')} | {_status(tc)} |")
        L.append("")
        L += _lora_gather(sa.get("lora_gather", {}))
        L += _skinny_products(sa.get("skinny_products", {}))
        L += _heading("### Decode stall while a long prompt is prefilled (ms)",
                      "| shape | rows | prompt | whole: max stall | chunked: max stall | plain step | whole: long TTFT | "
                      "chunked: long TTFT | same tokens | notes |")
        for name in s["shapes"]:
            cp = sa.get(f"{name}/chunked_prefill", {})
            runs = cp.get("runs", {})
            chunked = next((k for k in runs if k != "whole"), "-")
            L.append(f"| {name} | {_get(cp, 'rows')} | {_get(cp, 'prompt_length')} | "
                     f"{_get(runs, 'whole', 'max_stall_ms')} | {_get(runs, chunked, 'max_stall_ms')} | "
                     f"{_get(runs, 'whole', 'plain_step_ms')} | {_get(runs, 'whole', 'long_first_token_ms')} | "
                     f"{_get(runs, chunked, 'long_first_token_ms')} | {cp.get('same_tokens', '-')} | {_status(cp)} |")
        L.append("")
    mo = s.get("moe", {}).get("a3b_vs_dense")
    if mo:
        L += ["## Mixture of experts (Qwen3-30B-A3B shape, a few layers) vs dense of equal active parameters", "",
              "| model | LoRA fwd+bwd tok/s | MFU 4NT (active) | decode tok/s | notes |", "|---|---|---|---|---|"]
        for kind in ("moe", "dense"):
            L.append(f"| {kind} | {_get(mo, kind, 'train_tokens_per_s')} | {_get(mo, kind, 'train_mfu_4nt', pct=True)} | "
                     f"{_get(mo, kind, 'decode_tokens_per_s')} | {_status(mo)} |")
        L += [f"| MoE / dense | {_get(mo, 'train_moe_vs_dense')} | | {_get(mo, 'decode_moe_vs_dense')} | |", ""]
    return "\n".join(L)


def _lora_gather(lg: dict) -> list[str]:
    """The multi-adapter LoRA kernels (sample.lora_gather): before split-K against after, per
    projection and a whole layer, then the shrink's split sweep."""
    if not lg:
        return []
    L = _heading(f"### Multi-adapter LoRA kernels, one 1.7B decode layer, rank {lg.get('rank', '-')} (us per "
                 "call, CUDA-graph replay; old = before split-K, pair = shrink + expand)",
                 "| rows | adapters | projection | split | shrink old | shrink new (torch's sum) | expand | "
                 "pair new / old | torch pair | new vs old (max rel diff) | repeatable | by tiles: pair us, "
                 "vs new (max rel diff) | notes |")
    for ck in [k for k in lg if k.startswith("rows_")]:
        rows, adapters = ck[5:].split("_adapters_")
        for proj in [k for k in lg[ck] if k != "layer"]:
            r = lg[ck][proj]
            L.append(f"| {rows} | {adapters} | {proj} | {_get(r, 'split')} | {_get(r, 'shrink_old_us')} | "
                     f"{_get(r, 'shrink_new_us')} ({_get(r, 'shrink_torch_sum_us')}) | {_get(r, 'expand_us')} | "
                     f"{_get(r, 'pair_new_vs_old')} | {_get(r, 'torch_pair_us')} | {_get(r, 'max_rel_diff')} | "
                     f"{r.get('bitwise_repeatable', '-')} | {_get(r, 'segmented_pair_us')}, "
                     f"{_get(r, 'segmented_vs_new')} ({_get(r, 'segmented_max_rel_diff')}) | |")
        la = lg[ck].get("layer", {})
        L.append(f"| {rows} | {adapters} | **layer** | | | | | {_get(la, 'new_vs_old')} "
                 f"({_get(la, 'old_us')} -> {_get(la, 'new_us')} us) | {_get(la, 'torch_us')} | | | "
                 f"{_get(la, 'segmented_us')}, {_get(la, 'segmented_vs_new')} | |")
    if _status(lg):
        L.append(f"| - | - | - | - | - | - | - | - | - | - | - | - | {_status(lg)} |")
    L.append("")
    sw = lg.get("split_sweep")
    if sw:
        for proj, us in sw.get("shrink_us", {}).items():
            L.append(f"- shrink by split, {sw.get('rows')} rows, {sw.get('adapters')} adapters, {proj} (us, "
                     "partials summed): " + ", ".join(f"{k[6:]}: {_fmt(v)}" for k, v in us.items()))
        for proj, us in sw.get("expand_us_by_block", {}).items():
            L.append(f"- expand by output block, {sw.get('rows')} rows, {sw.get('adapters')} adapters, {proj} "
                     "(us): " + ", ".join(f"{k[6:]}: {_fmt(v)}" for k, v in us.items()))
        L.append("")
    return L


def _skinny_products(sp: dict) -> list[str]:
    """A decode step's products with the weights (products.products): cuBLAS against the
    skinny-product kernel per projection and row count, then the kernel's sweep."""
    if not sp:
        return []
    L = _heading(f"### A decode step's products with the weights, {sp.get('shape', '-')} shape, {sp.get('dtype', '-')} (us per "
                 "product, CUDA-graph replay, weights read from HBM; share of the copy rate)",
                 "| projection | rows | cuBLAS | kernel | kernel / cuBLAS | splits | max rel diff | notes |")
    for proj in [k for k, v in sp.items() if isinstance(v, dict) and "in" in v]:
        for rk in [k for k in sp[proj] if k.startswith("rows_")]:
            r = sp[proj][rk]
            L.append(f"| {proj} ({sp[proj]['in']} -> {sp[proj]['out']}) | {rk[5:]} | {_get(r, 'cublas_us')} "
                     f"({_get(r, 'cublas_of_copy_rate', pct=True)}) | {_get(r, 'kernel_us')} "
                     f"({_get(r, 'kernel_of_copy_rate', pct=True)}) | {_get(r, 'kernel_vs_cublas')} | "
                     f"{_get(r, 'plan', 'splits')} | {_get(r, 'max_rel_diff')} | |")
    if _status(sp):
        L.append(f"| - | - | - | - | - | - | - | {_status(sp)} |")
    L.append("")
    for rk in sorted({k.rsplit("_rows_", 1)[1] for k in sp if k.startswith("step_products_")}, key=int):
        L.append(f"- a 28-layer step's products at {rk} rows: cuBLAS {_get(sp, f'step_products_cublas_us_rows_{rk}')} "
                 f"us, kernel {_get(sp, f'step_products_kernel_us_rows_{rk}')} us")
    for proj in [k for k, v in sp.items() if isinstance(v, dict) and "in" in v]:
        for rk in [k for k in sp[proj] if k.startswith("rows_")]:
            sweep = sp[proj][rk].get("sweep_us")
            if sweep:
                L.append(f"- kernel sweep, {proj}, {rk[5:]} rows (us): "
                         + ", ".join(f"{k}: {_fmt(v)}" for k, v in sweep.items()))
    L.append("")
    return L


def _profiles(s: dict) -> list[str]:
    """Per profiled step (bench/gpu/profile.py): where its device time goes, then its costliest kernels."""
    found = [(f"{part}/{key}", item) for part in ("train", "sample") for key, item in s.get(part, {}).items()
             if key.endswith("profile")]
    if not found:
        return []
    L = _heading("## Where a step's time goes (ms per step; profiled eagerly, replay_profile from CUDA graphs)",
                 "| step | source | device ms | wall ms | kernels | by family (ms) | notes |")
    tops: list[str] = []
    for key, item in found:
        for case, t in item.items():
            if not isinstance(t, dict) or "families_ms" not in t:
                continue
            fam = ", ".join(f"{k} {v:.2f}" for k, v in t["families_ms"].items())
            idle = (f"device idle between kernels: {_fmt(t['idle_short_ms'])} ms in gaps <= 10 us, "
                    f"{_fmt(t['idle_long_ms'])} ms in {_fmt(t['long_idles'])} longer" if "idle_short_ms" in t else "")
            if "unprofiled_ms_per_step" in t:  # replay_profile: where a replayed step's idle time lies
                idle = "; ".join(x for x in (idle, (
                    f"unprofiled ms per step: the sampler's {_fmt(t['unprofiled_ms_per_step'])}, "
                    f"a burst alone {_fmt(t.get('burst_alone_ms_per_step'))}, "
                    f"the graph's replays alone {_fmt(t.get('replays_alone_ms_per_step'))}")) if x)
            L.append(f"| {key} {case} | {t['source']} | {_fmt(t['device_ms'])} | {_fmt(t['wall_ms'])} | "
                     f"{_fmt(t['kernels'])} | {fam} | {idle} |")
            tops += [f"{key} {case}: " + "; ".join(f"{n} {ms:.3g} ms x{c:g}" for n, ms, c in t["top"][:8])]
            if t.get("long_idles_between"):  # where the device waited longest (ms and gaps per step)
                tops += [f"{key} {case} idle after -> before: " + "; ".join(
                    f"{a} -> {b} {ms:.3g} ms x{n:g}" for a, b, ms, n in t["long_idles_between"])]
            if t.get("host_top"):  # the host's side of a replayed step (cProfile, own ms per step)
                tops += [f"{key} {case} host: " + "; ".join(f"{n} {ms:.3g} ms" for n, ms, _ in t["host_top"])]
        if _status(item):
            L.append(f"| {key} | - | - | - | - | - | {_status(item)} |")
    return L + [""] + [f"- {line}" for line in tops] + [""]


def _copies(s: dict) -> list[str]:
    """How long the host waited to copy host data to a busy device (train.copies_behind_work)."""
    c = s.get("train", {}).get("copies_behind_work")
    if not c or "pageable_non_blocking" not in c:
        return [f"- copies behind queued work: {_status(c)}", ""] if c and _status(c) else []
    return [f"- a {c['bytes']}-byte copy to the device behind {_fmt(c['to_device']['busy_ms_median'])} ms of queued "
            f"work, the host's wait: pageable non-blocking {_fmt(c['pageable_non_blocking']['host_ms_median'])} ms, "
            f"`to_device` (page-locked first) {_fmt(c['to_device']['host_ms_median'])} ms", ""]


def _allocator(s: dict) -> list[str]:
    """The items inside which the caching allocator called cudaFree (each a wait for every kernel
    queued): its retries (cached blocks given back to fit an allocation) and its frees."""
    found = [f"{part}/{key}: {item['allocator']['retries']} retries, {item['allocator']['device_frees']} frees"
             for part in ("train", "sample", "moe") for key, item in s.get(part, {}).items()
             if isinstance(item, dict) and isinstance(item.get("allocator"), dict)
             and (item["allocator"]["retries"] or item["allocator"]["device_frees"])]
    return ["- cudaFree inside items (each waits for the device): " + ("; ".join(found) if found else "none"), ""] \
        if any("allocator" in item for part in ("train", "sample", "moe")
               for item in s.get(part, {}).values() if isinstance(item, dict)) else []
