"""What ``bench_ops.py`` reports: each batch row's time and byte ratios, the table per k on stdout,
and the plot (time and roofline fraction per kernel, the ratios over the snapshot and the engine
kernel)."""

from __future__ import annotations

from pathlib import Path

from _results import pyplot
from ops_workloads import KERNELS, LAZY_MAX_PENDING
from peers import PEER_KERNELS
from roofline import GIB

LABELS = {
    "verify": "verify", "commit_nW": "commit n=W", "commit_n1": "commit n=1",
    "snapshot": "snapshot (native)",
    "folded": "folded verify (n_prev=W)",
    "native_engine": "engine's native kernel (8-wide V slice, 1 warp)",
    "closed_form_verify": "closed-form verify (fast)",
    "closed_form_folded": "closed-form folded (fast, n_prev=W)",
    "lazy": f"lazy (fast, L={LAZY_MAX_PENDING}, W-1 accepted)",
    "fla": "fla fused_recurrent", "fla_contig": "fla fused_recurrent, contiguous h0",
}


def batch_row(k: int, W: int, B: int, n_sets: int, kernels: dict, moved: dict, peer_err: float | None) -> dict:
    """One batch size's JSON row: its kernels' entries (``roofline.kernel_stats``), the sums and
    time ratios over the snapshot, the engine kernel and the peer, and the byte ratios
    (``moved``: ``roofline.bytes_moved``)."""
    t = {name: kernels[name]["time_us"] for name in kernels}
    snap = t["snapshot"]
    row = {
        "k": k,
        "W": W,
        "batch": B,
        "tokens": B * W,
        "index_sets": n_sets,
        "kernels": kernels,
        "verify+commit_nW_us": t["verify"] + t["commit_nW"],
        "verify+commit_n1_us": t["verify"] + t["commit_n1"],
        "snapshot_us": snap,
        "ratio_vcW_over_snapshot": (t["verify"] + t["commit_nW"]) / snap,
        "ratio_vc1_over_snapshot": (t["verify"] + t["commit_n1"]) / snap,
        "ratio_folded_over_snapshot": t["folded"] / snap,
        "ratio_folded_over_vcW": t["folded"] / (t["verify"] + t["commit_nW"]),
        "native_engine_us": t.get("native_engine"),
        "ratio_vcW_over_native_engine": ((t["verify"] + t["commit_nW"]) / t["native_engine"]
                                         if "native_engine" in t else None),
        "ratio_folded_over_native_engine": (t["folded"] / t["native_engine"]
                                            if "native_engine" in t else None),
        "ratio_closed_form_vcW_over_snapshot": (t["closed_form_verify"] + t["commit_nW"]) / snap,
        "ratio_closed_form_folded_over_snapshot": t["closed_form_folded"] / snap,
        "ratio_lazy_over_snapshot": t["lazy"] / snap,
        "ratio_lazy_over_native_engine": t["lazy"] / t["native_engine"] if "native_engine" in t else None,
        "ratio_closed_form_verify_over_verify": t["closed_form_verify"] / t["verify"],
        "bytes_ratio_vcW_over_snapshot":
            (moved["verify"] + moved["commit_nW"]) / moved["snapshot"],
        "bytes_ratio_vc1_over_snapshot":
            (moved["verify"] + moved["commit_n1"]) / moved["snapshot"],
        "bytes_ratio_folded_over_snapshot": moved["folded"] / moved["snapshot"],
    }
    if "fla" in t:
        row["ratio_fla_over_snapshot"] = t["fla"] / snap
        row["ratio_folded_over_fla"] = t["folded"] / t["fla"]
        row["fla_rel_err_vs_verify"] = peer_err
    return row


SHORT = {"verify": ("verify", "ver"), "commit_nW": ("commit_W", "cW"),
         "commit_n1": ("commit_1", "c1"), "snapshot": ("snapshot", "snap"),
         "folded": ("folded", "fold"), "fla": ("fla", "fla"), "fla_contig": ("fla_cont", "flac"),
         "native_engine": ("engine", "eng"), "closed_form_verify": ("cf_verify", "cfv"),
         "closed_form_folded": ("cf_folded", "cff"), "lazy": ("lazy", "lazy")}


def print_table(res: dict) -> None:
    c = res["config"]
    print(f"{res['device']}  torch {res['torch']}  triton {res['triton']}  timing {res['timing']}")
    print(f"H={c['H']} HV={c['HV']} K={c['K']} V={c['V']} k={','.join(map(str, c['k']))} "
          f"state={c['state_dtype']} act={c['act_dtype']}  slot={c['slot_bytes'] / 2**20:.3g} MiB  "
          f"pool={c['pool_bytes'] / GIB:.3g} GiB")
    print(f"copy bandwidth: {res['copy_bandwidth_gbps']:.1f} GB/s "
          f"({res['copy']['bytes'] / GIB:.3g} GiB moved in {res['copy']['time_us']:.1f} us)")
    f = res["fma"]
    print(f"fp32 FMA rate: {f['tops']:.3g} Tops/s = {f['tflops']:.3g} TFLOP/s "
          f"({f['impl']}: {f['elements']} elements x {f['iters']} iters in {f['time_us']:.1f} us)")
    print(f"record per token / fp32 state slot: {100 * res['record_bytes_per_token_over_state']:.2f}%"
          f"  (target < 1.5%)")
    print(f"peer: {res['peer']['note']}")
    print("times: median us per call; %roof: floor / time with floor = max(bytes / copy bw, "
          "ops / FMA rate), m|c: memory or compute sets the floor; ratios in time")
    names = [n for n in (*KERNELS, *PEER_KERNELS) if any(n in r["kernels"] for r in res["rows"])]
    head = (f"{'B':>5} | " + " ".join(f"{SHORT[n][0]:>9}" for n in names)
            + " | %roof " + " ".join(f"{SHORT[n][1]:>4}" for n in names)
            + f" | {'(v+cW)/s':>8} {'(v+c1)/s':>8} {'fold/s':>7} {'fold/(v+cW)':>11}"
            + f" {'(v+cW)/eng':>10} {'fold/eng':>8}")
    for kv in c["k"]:
        rows = [r for r in res["rows"] if r["k"] == kv]
        r0 = rows[0]
        print(f"\nk={kv} (W={r0['W']})  bytes ratios (same for every B): "
              f"(v+cW)/snapshot {r0['bytes_ratio_vcW_over_snapshot']:.3f}, "
              f"(v+c1)/snapshot {r0['bytes_ratio_vc1_over_snapshot']:.3f}, "
              f"folded/snapshot {r0['bytes_ratio_folded_over_snapshot']:.3f}")
        print(head)
        print("-" * len(head))
        for r in rows:
            ks = r["kernels"]
            times = " ".join(f"{ks[n]['time_us']:9.2f}" if n in ks else f"{'-':>9}" for n in names)
            roof = " ".join(f"{100 * ks[n]['frac_roofline']:3.0f}{ks[n]['bound'][0]}" if n in ks
                            else f"{'-':>4}" for n in names)
            print(f"{r['batch']:>5} | {times} |       {roof} "
                  f"| {r['ratio_vcW_over_snapshot']:8.3f} {r['ratio_vc1_over_snapshot']:8.3f} "
                  f"{r['ratio_folded_over_snapshot']:7.3f} {r['ratio_folded_over_vcW']:11.3f} "
                  f"{_ratio(r['ratio_vcW_over_native_engine']):>10} {_ratio(r['ratio_folded_over_native_engine']):>8}")
        if any("lazy" in r["kernels"] for r in rows):
            print(f"fast mode (k={kv}): {'B':>5} | {'cfv %copy':>9} {'cfv/ver':>7} | {'(cfv+cW)/s':>10} "
                  f"{'cff/s':>6} {'lazy/s':>6} {'lazy/eng':>8}")
            for r in rows:
                cfv = r["kernels"]["closed_form_verify"]
                print(f"{'':>19}{r['batch']:>5} | {100 * cfv['frac_copy_bw']:8.0f}% "
                      f"{r['ratio_closed_form_verify_over_verify']:7.3f} | "
                      f"{r['ratio_closed_form_vcW_over_snapshot']:10.3f} "
                      f"{r['ratio_closed_form_folded_over_snapshot']:6.3f} {r['ratio_lazy_over_snapshot']:6.3f} "
                      f"{_ratio(r['ratio_lazy_over_native_engine']):>8}")
    if "ring_bytes_per_slot_over_state" in res:
        print("lazy record ring per slot / fp32 state: " + ", ".join(
            f"L={L}: {100 * f['pending']:.1f}% pending ({100 * f['ring']:.1f}% with the window's positions)"
            for L, f in res["ring_bytes_per_slot_over_state"].items()))


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


#: The ratio panels of the plot: (top row key, bottom row key, the baseline's name).
RATIO_PANELS = (("ratio_vcW_over_snapshot", "ratio_folded_over_snapshot", "snapshot"),
                ("ratio_vcW_over_native_engine", "ratio_folded_over_native_engine", "engine kernel"),
                ("ratio_closed_form_folded_over_snapshot", "ratio_lazy_over_snapshot", "snapshot"))
RATIO_TITLES = {"ratio_vcW_over_snapshot": "(verify + commit n=W)", "ratio_folded_over_snapshot": "folded",
                "ratio_vcW_over_native_engine": "(verify + commit n=W)", "ratio_folded_over_native_engine": "folded",
                "ratio_closed_form_folded_over_snapshot": "fast folded", "ratio_lazy_over_snapshot": "lazy"}


def save_plot(res: dict, path: Path) -> bool:
    """One column per kernel: median time (top) and roofline fraction (bottom) vs batch, one
    colour per k; the last column holds the ratios (v + commit n=W) / snapshot and
    folded / snapshot."""
    plt = pyplot()
    if plt is None:
        return False
    rows, c = res["rows"], res["config"]
    names = [n for n in (*KERNELS, *PEER_KERNELS) if any(n in r["kernels"] for r in rows)]
    ks = c["k"]
    colours = {k: plt.cm.viridis(i / max(1, len(ks) - 1) * 0.9) for i, k in enumerate(ks)}
    ncols = 4
    groups = -(-(len(names) + len(RATIO_PANELS)) // ncols)
    fig, axes = plt.subplots(2 * groups, ncols, figsize=(4 * ncols, 5.6 * groups), squeeze=False)
    times = [r["kernels"][n]["time_us"] for r in rows for n in names if n in r["kernels"]]
    t_lim = (min(times) / 1.5, max(times) * 1.5)
    f_max = max(1.05, max(r["kernels"][n]["frac_roofline"] for r in rows for n in names
                          if n in r["kernels"]) * 1.05)

    def series(k, name=None, key=None):
        """(batches, values) of k's rows: ``r["kernels"][name][key]``, or ``r[key]``."""
        sel = [r for r in rows if r["k"] == k and (name is None or name in r["kernels"])]
        return ([r["batch"] for r in sel],
                [r["kernels"][name][key] if name is not None else r[key] for r in sel])

    for idx in range(groups * ncols):
        ax_t, ax_f = axes[2 * (idx // ncols), idx % ncols], axes[2 * (idx // ncols) + 1, idx % ncols]
        if idx < len(names):
            name = names[idx]
            for k in ks:
                ax_t.plot(*series(k, name, "time_us"), marker="o", ms=3, color=colours[k],
                          label=f"k={k}")
                ax_f.plot(*series(k, name, "frac_roofline"), marker="o", ms=3, color=colours[k],
                          label=f"k={k}")
            ax_t.set(yscale="log", ylim=t_lim, title=LABELS[name], ylabel="median time (us)")
            ax_f.set(ylim=(0, f_max), ylabel="fraction of roofline floor")
        elif idx < len(names) + len(RATIO_PANELS) and any(r.get(RATIO_PANELS[idx - len(names)][0]) for r in rows):
            base = RATIO_PANELS[idx - len(names)]
            for ax, key in ((ax_t, base[0]), (ax_f, base[1])):
                for k in ks:
                    ax.plot(*series(k, key=key), marker="o", ms=3, color=colours[k], label=f"k={k}")
                ax.set(title=f"{RATIO_TITLES[key]} / {base[2]}", ylabel="time ratio")
                ax.axhline(1.0, color="grey", lw=0.8)
        else:
            ax_t.axis("off")
            ax_f.axis("off")
            continue
        for ax in (ax_t, ax_f):
            bs = sorted({r["batch"] for r in rows})
            ax.set_xscale("log")
            ax.set_xticks(bs, [str(b) for b in bs], fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
        ax_f.set_xlabel("batch (rows)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(ks), fontsize=9)
    fig.suptitle(f"{res['device']}: GDN ops per layer and step, HV={c['HV']} K={c['K']} V={c['V']}, "
                 f"{c['state_dtype']} state; copy {res['copy_bandwidth_gbps']:.0f} GB/s, "
                 f"FMA {res['fma']['tflops']:.3g} TFLOP/s", x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
