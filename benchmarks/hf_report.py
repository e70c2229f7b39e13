"""What ``bench_hf_generate.py`` reports for a random-weight run: the table on stdout (tokens/s and
speedups per run, agreement, acceptance, single forwards, wall time) and the bar chart."""

from __future__ import annotations

from pathlib import Path

from _results import pyplot
from hf_environment import same_kernels_why
from hf_runs import RUNS

#: The baselines the speedups are reported over.
BASELINES = ("hf", "hf-torch")


def print_table(res: dict) -> None:
    env, c = res["environment"], res["config"]
    k = c["num_draft_tokens"]
    print()
    print(f"{env['device']}  torch {env['torch']}  transformers {env['transformers']}  "
          f"fla-core {env['fla_core'] or '-'}")
    print(f"{c['kind']} hidden={c['hidden_size']} layers={c['num_layers']} GDN {c['linear_num_key_heads']}k/"
          f"{c['linear_num_value_heads']}v x {c['linear_head_dim']}  attn {c['num_attention_heads']}q/"
          f"{c['num_key_value_heads']}kv x {c['head_dim']}  "
          + (f"experts {c['num_experts']} x {c['moe_intermediate_size']} top-{c['num_experts_per_tok']} + shared  "
             if "num_experts" in c else f"mlp {c['intermediate_size']}  ")
          + f"({c['params'] / 1e6:.0f}M)  {c['dtype']}, state {c['state_dtype']}")
    print(f"prompt {c['prompt_len']} tokens, {c['new_tokens']} new tokens, k={k} drafts, batch 1, greedy, "
          f"median of {c['repeats']}")
    print_kernels(res)
    tps = res["tokens_per_s"]
    head = (f"{'run':<13} | {'tok/s':>8} {'time s':>8} | " + " ".join(f"{'vs ' + b:>11}" for b in BASELINES)
            + f" | {'same as hf':>11}")
    print(head)
    print("-" * len(head))
    for name in RUNS:
        if name not in res["runs"]:
            why = res.get("skipped", {}).get(name) or (
                "--loop-only" if c.get("loop_only") and name in ("ours", "ours+lookup", "graphs", "graphs+lookup")
                else "--no-graphs" if "graphs" in name else "--no-loop or --batch without 1" if "loop" in name
                else "--no-hf-torch")
            print(f"{name:<13} | skipped ({why})")
            continue
        r = res["runs"][name]
        if name == "hf":
            same = "-"
        else:
            a = res["agreement"][f"hf vs {name}"]
            same = "yes" if a["equal"] else f"no @ {a['first_diff']}"
        vs = " ".join(f"{tps[name] / tps[b]:10.2f}x" if b in tps else f"{'-':>11}" for b in BASELINES)
        print(f"{name:<13} | {r['tokens_per_s']:8.1f} {r['time_s']:8.3f} | {vs} | {same:>11}")
    acc = res["acceptance"]
    if acc:
        print(f"lookup: {acc['rounds']} rounds, mean accepted length {acc['mean_accepted_length']:.2f}, "
              f"acceptance rate {acc['acceptance_rate']:.2f}, per position "
              + " ".join(f"{x:.2f}" for x in acc["position_rates"]))
    g = res.get("graphs")
    if g:
        ga = g["acceptance"]
        print(f"graphs: {g['captured']} graphs captured, {g['replays']} replays, {g['eager_forwards']} eager forwards"
              f"{', capture failed: ' + g['failed'] if g['failed'] else ''}; graphs+lookup: {ga['rounds']} rounds, "
              f"mean accepted length {ga['mean_accepted_length']:.2f}")
    for pair, a in res["agreement"].items():
        if not a["equal"] and "token_a" not in a:
            print(f"  {pair}: the shorter run is a prefix of the other (it ended at new token {a['first_diff']})")
        elif not a["equal"]:
            print(f"  {pair}: first difference at new token {a['first_diff']} "
                  f"({a['token_a']} vs {a['token_b']}); {a['gap_model']} model there: top1-top2 "
                  f"{a['top1_minus_top2']:.4g}, logit(a)-logit(b) {a['logit_a_minus_b']:.4g}")
    if res["plain_min_logit_gap"] is not None:
        print(f"  smallest top1-top2 logit gap along hf: {res['plain_min_logit_gap']:.4g}")
    print_loop(res)
    fw = res["forwards"]
    print(f"single forwards, warm cache (median ms): W=1 decode" + (f", W={k + 1} verify" if fw["ours"] else ""))
    if fw["ours"]:
        o1, oW = fw["ours"]["1"], fw["ours"][str(k + 1)]
        print(f"  ours: fwd {o1['forward_ms']:.3f} / {oW['forward_ms']:.3f}  (x{fw['ours_verify_over_decode']:.2f}); "
              f"crop {o1['crop_ms']:.3f} / {oW['crop_ms']:.3f}; fwd+crop x{fw['ours_verify_over_decode_with_crop']:.2f}")
    if "error" in fw["hf"]:
        print(f"  hf:   {fw['hf']['error']}")
    else:
        h = " / ".join(f"{fw['hf'][w]['forward_ms']:.3f}" for w in fw["hf"])
        ratio = f"x{fw['hf_verify_over_decode']:.2f}; " if "hf_verify_over_decode" in fw else ""
        print(f"  hf:   fwd {h}  ({ratio}transformers' cache, state advancing)")
    print("wall time (s): " + ", ".join(f"{n} {t:.1f}" for n, t in res["phases_s"].items())
          + f"; total {res['total_s']:.0f}")
    torch_part = ""
    if res["speedup_lookup_over_hf_torch"] is not None:
        torch_part = (f"; over hf-torch: ours+lookup {res['speedup_lookup_over_hf_torch']:.2f}x, "
                      f"ours {res['speedup_ours_over_hf_torch']:.2f}x, hf {res['speedup_hf_over_hf_torch']:.2f}x")
    if res["speedup_ours_over_hf"] is not None:
        print(f"speedup over hf: ours+lookup {res['speedup_lookup_over_hf']:.2f}x, ours {res['speedup_ours_over_hf']:.2f}x"
              f"{torch_part}; ours+lookup over ours {res['speedup_lookup_over_ours']:.2f}x")
    if res.get("speedup_graphs_lookup_over_hf") is not None:
        print(f"speedup over hf: graphs+lookup {res['speedup_graphs_lookup_over_hf']:.2f}x, graphs "
              f"{res['speedup_graphs_over_hf']:.2f}x; graphs+lookup over graphs "
              f"{res['speedup_graphs_lookup_over_graphs']:.2f}x")


def print_loop(res: dict) -> None:
    """The decode loop's section: per batch size, loop+lookup over loop beside the tokens per
    round; the forward's GPU time against the floor and the wall time per token."""
    lp = res.get("loop")
    if not lp:
        return
    print(f"decode loop ({'CUDA graphs' if lp['cuda_graphs'] else 'eager'}): batch | loop tok/s | +lookup tok/s | "
          f"ratio | tokens/round | ratio / tokens-per-round")
    for B, e in lp["by_batch"].items():
        mal = e["mean_accepted_length"]
        share = f"{e['share_of_accepted_length']:.2f}" if e["share_of_accepted_length"] else "-"
        print(f"  {B:>5} | {e['loop_tokens_per_s']:10.1f} | {e['loop_lookup_tokens_per_s']:13.1f} | "
              f"{e['loop_lookup_over_loop']:5.2f} | {mal or 0:12.2f} | {share}"
              + (f"  (capture failed: {e['capture_failed']})" if e["capture_failed"] else ""))
    if "gpu_ms_per_decode_forward" in lp:
        per_token = (f"; loop at batch 1: {lp['loop_ms_per_token']:.2f} ms per token = "
                     f"{lp['loop_ms_per_token_over_gpu_forward']:.2f}x the decode forward" if "loop_ms_per_token" in lp else "")
        print(f"  GPU time per forward (kernels summed): decode {lp['gpu_ms_per_decode_forward']:.3f} ms "
              f"({lp['kernels_per_decode_forward']} kernels), verify W={lp['num_draft_tokens'] + 1} "
              f"{lp['gpu_ms_per_verify_forward']:.3f} ms (verify / decode: " + ", ".join(
                  f"W={w} {r:.2f}x" for w, r in lp["verify_over_decode_gpu_by_width"].items())
              + f"); weight-read floor {lp['weight_read_floor_ms']:.3f} ms "
              f"({lp['param_bytes'] / 1e9:.2f} GB at {lp['copy_bandwidth_GBps']:.0f} GB/s): decode = "
              f"{lp['gpu_forward_over_floor']:.2f}x the floor{per_token}")


def print_kernels(res: dict) -> None:
    """The kernels each baseline ran on (and whether ``hf-torch`` is ``hf``'s path)."""
    if res["hf_kernels"]:
        print("hf kernels: " + ", ".join(f"{n}={s}" for n, s in res["hf_kernels"].items()))
    if res["hf_torch_same_as_hf"]:
        print(f"hf-torch kernels: the same as hf ({same_kernels_why(res['hf_kernels'])}), so hf-torch repeats "
              "hf's path")
    elif res["hf_torch_kernels"]:
        print("hf-torch kernels: " + ", ".join(f"{n}={s}" for n, s in res["hf_torch_kernels"].items()))


def save_plot(res: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    c, k = res["config"], res["config"]["num_draft_tokens"]
    fig, (ax_g, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    tps = res["tokens_per_s"]
    names = [n for n in RUNS if n in tps]
    labels = {"hf": "hf generate", "hf-torch": "hf generate\n(torch reference)",
              "hf_lookup": f"hf's own lookup k={k}", "hf_static": "hf static cache\n(compiled)", "ours": "ours generate",
              "ours+lookup": f"ours + lookup k={k}", "graphs": "ours generate\n(CUDA graphs)",
              "graphs+lookup": f"ours + lookup k={k}\n(CUDA graphs)", "loop": "ours decode loop",
              "loop+lookup": f"decode loop\n+ lookup k={k}"}
    colors = {"hf": "tab:gray", "hf-torch": "silver", "hf_lookup": "tab:brown", "hf_static": "tab:red", "ours": "tab:blue", "ours+lookup": "tab:green",
              "graphs": "tab:purple", "graphs+lookup": "tab:olive", "loop": "tab:cyan", "loop+lookup": "tab:pink"}
    vals = [tps[n] for n in names]
    bars = ax_g.bar([labels[n] for n in names], vals, color=[colors[n] for n in names])
    for bar, v in zip(bars, vals):
        vs = "\n".join(f"{v / tps[b]:.2f}x {b}" for b in BASELINES if b in tps)
        ax_g.annotate(f"{v:.0f}\n{vs}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax_g.set(ylabel="tokens / s", title=f"generate, {c['new_tokens']} new tokens, batch 1")
    ax_g.margins(y=0.2)
    ax_g.tick_params(axis="x", labelsize=7, labelrotation=30)

    fw = res["forwards"]
    widths = ["1", str(k + 1)]
    x = range(len(widths))
    series = [] if not fw["ours"] else [("ours fwd", [fw["ours"][w]["forward_ms"] for w in widths]),
                                        ("ours crop", [fw["ours"][w]["crop_ms"] for w in widths])]
    if "error" not in fw["hf"]:
        series.append(("hf fwd", [fw["hf"][w]["forward_ms"] if w in fw["hf"] else 0.0 for w in widths]))
    n = len(series)
    for i, (label, ys) in enumerate(series):
        ax_f.bar([xi + (i - (n - 1) / 2) * 0.8 / n for xi in x], ys, width=0.8 / n, label=label)
    ax_f.set_xticks(list(x), [f"W={w}" for w in widths])
    ax_f.set(ylabel="median ms", title="one forward, warm cache")
    ax_f.legend(fontsize=8)
    for ax in (ax_g, ax_f):
        ax.grid(True, axis="y", alpha=0.3)
    acc = res["acceptance"] or {}
    if not acc and res.get("loop") and "1" in res["loop"]["by_batch"]:
        acc = res["loop"]["by_batch"]["1"]  # the decode loop's prompt lookup, where transformers' loop did not run
    mal = acc.get("mean_accepted_length")
    fig.suptitle(f"{res['environment']['device']}: {c['kind']} {c['params'] / 1e6:.0f}M, {c['dtype']}"
                 + (f"; mean accepted length {mal:.2f}" if mal is not None else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
