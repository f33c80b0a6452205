r"""Accumulation and many processes (taught in book/scale/accumulation_distributed).

Two kinds of content:

* the **alpha-beta cost** of an all-reduce, on paper: with :math:`N` ranks, a message
  of :math:`B` bytes, a latency :math:`\alpha` per message and a bandwidth
  :math:`\beta` (bytes per second) per link,

  .. math::
      t_\text{ring} = 2(N-1)\,\alpha + \frac{2(N-1)}{N}\,\frac{B}{\beta},
      \qquad
      T_\text{rd} = \lceil\log_2 N\rceil\,\Bigl(\alpha + \frac{B}{\beta}\Bigr),

  the ring (a reduce-scatter then an all-gather, :math:`N-1` steps each, every step
  moving :math:`B/N` bytes) and recursive doubling (:math:`\log_2 N` rounds, each
  exchanging the whole message), the short-message choice. :func:`cost_table`
  tabulates both for the gradients and for a decision of a few bytes, and
  :func:`allreduce_cost_html` is a kernel-free figure over the same formulas
  (dependency-free JavaScript, the reader holds the sliders);
* the **shard norms** of the chapter's FSDP2 demo against the global norm, as a bar
  chart (:func:`shard_norm_figure`), from the summary that
  :mod:`gradlab_book.distributed_demo` writes.

The link figures in :data:`HYPOTHETICAL_LINK` are round, made-up numbers for the
arithmetic, not measurements of any machine. What NCCL actually takes for a message of a
few bytes is in :data:`MEASURED_SMALL_ALLREDUCE`: published ``nccl-tests`` runs, cited
one by one. NCCL does not run a ring for 8 bytes: it models every algorithm and protocol
({Ring, Tree, CollNet, NVLS} x {LL, LL128, Simple}) for each message size and takes the
fastest, a tree with the low-latency LL protocol for small messages.
"""

# The text is typeset for readers: α, β, µ and × are meant.
# ruff: noqa: RUF001

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from gradlab_book.direct import PALETTE, DirectHTML
from gradlab_book.plots import CLIP, KEEP, NONE, new_figure

__all__ = [
    "DECISION_BYTES",
    "HYPOTHETICAL_LINK",
    "MEASURED_SMALL_ALLREDUCE",
    "Link",
    "Measurement",
    "allreduce_cost_html",
    "cost_table",
    "format_cost_table",
    "format_seconds",
    "recursive_doubling_seconds",
    "ring_allreduce_seconds",
    "shard_norm_figure",
    "shard_norms",
]


@dataclass(frozen=True)
class Link:
    """A link in the alpha-beta model: latency per message and bandwidth."""

    alpha_s: float  # seconds per message
    bandwidth_Bps: float  # bytes per second

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"alpha_s must be a finite number >= 0, got {self.alpha_s!r}")
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth_Bps must be positive, got {self.bandwidth_Bps!r}")


#: Made-up round numbers for the arithmetic: 5 µs per message, 25 GB/s (200 Gb/s).
HYPOTHETICAL_LINK = Link(alpha_s=5e-6, bandwidth_Bps=25e9)

#: A decision's message: a float32 norm and a float32 non-finite flag.
DECISION_BYTES = 8


@dataclass(frozen=True)
class Measurement:
    """One published ``nccl-tests`` all_reduce_perf line for a message of a few bytes."""

    gpus: int
    nodes: int
    hardware: str
    nbytes: int
    seconds: float  # the out-of-place time the run printed
    source: str  # where it was published (a public issue thread)
    note: str = ""


#: Small all-reduces as NCCL ran them (``all_reduce_perf``, out-of-place, float sum),
#: copied from the public threads named; the book measures none (no GPU here).
MEASURED_SMALL_ALLREDUCE = (
    Measurement(
        gpus=8,
        nodes=1,
        hardware="8 GeForce RTX 3090, PCIe, one process (-g 8)",
        nbytes=8,
        seconds=54.18e-6,
        source="https://github.com/NVIDIA/nccl/issues/1439",
    ),
    Measurement(
        gpus=16,
        nodes=2,
        hardware="2 nodes of 8 H20, InfiniBand NDR (16 ConnectX-7), NCCL 2.21.5",
        nbytes=8,
        seconds=47.60e-6,
        source="https://github.com/NVIDIA/nccl/issues/1244",
        note="NCCL_ALGO=NVLSTree",
    ),
)


def _check(n_ranks: int, nbytes: float) -> None:
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive int, got {n_ranks!r}")
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")


def ring_allreduce_seconds(n_ranks: int, nbytes: float, link: Link = HYPOTHETICAL_LINK) -> float:
    r"""Ring all-reduce: :math:`2(N-1)\alpha + \frac{2(N-1)}{N} B / \beta` (0 for one rank)."""
    _check(n_ranks, nbytes)
    n = n_ranks
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.bandwidth_Bps


def recursive_doubling_seconds(
    n_ranks: int, nbytes: float, link: Link = HYPOTHETICAL_LINK
) -> float:
    r"""Recursive doubling: :math:`\lceil\log_2 N\rceil (\alpha + B/\beta)` (0 for one rank)."""
    _check(n_ranks, nbytes)
    rounds = math.ceil(math.log2(n_ranks)) if n_ranks > 1 else 0
    return rounds * (link.alpha_s + nbytes / link.bandwidth_Bps)


def format_seconds(t: float) -> str:
    """A duration with three significant digits in s, ms, µs or ns."""
    if t == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


def cost_table(
    ranks: Sequence[int] = (8, 64, 1024, 4096),
    grad_bytes: float = 2e9,
    link: Link = HYPOTHETICAL_LINK,
    collectives: int = 3,
) -> list[dict[str, float]]:
    """Per N: the gradients' ring all-reduce, one decision reduce (ring, recursive
    doubling), and ``collectives`` separate decision reduces (ring), in seconds."""
    rows = []
    for n in ranks:
        grads = ring_allreduce_seconds(n, grad_bytes, link)
        ring = ring_allreduce_seconds(n, DECISION_BYTES, link)
        rows.append(
            {
                "ranks": n,
                "gradients": grads,
                "decision_ring": ring,
                "decision_rd": recursive_doubling_seconds(n, DECISION_BYTES, link),
                "decisions_ring": collectives * ring,
                "share_ring": ring / grads,
            }
        )
    return rows


def format_cost_table(rows: list[dict[str, float]], collectives: int = 3) -> str:
    heads = (
        "ranks N",
        "gradients (ring)",
        "8 B (ring)",
        "8 B (rec. doubling)",
        f"{collectives} x 8 B (ring)",
    )
    width = (8, 17, 12, 20, 15)
    lines = ["".join(f"{h:>{w}}" for h, w in zip(heads, width, strict=True))]
    for row in rows:
        cells = [f"{row['ranks']}"] + [
            format_seconds(row[k])
            for k in ("gradients", "decision_ring", "decision_rd", "decisions_ring")
        ]
        lines.append("".join(f"{c:>{w}}" for c, w in zip(cells, width, strict=True)))
    return "\n".join(lines)


# ------------------------------------------------------------------ shard norms


def shard_norms(summary: dict, key: str = "2") -> dict[str, list[float] | float]:
    """From the demo's summary: each rank's shard norm, the global norm, the reference,
    and the norm put together from the shard norms in float64 (root of the sum of
    p-th powers, or the maximum for ``key="inf"``)."""
    d = summary["fsdp"][key]
    local = [float(v) for v in d["local"]]
    combined = max(local) if key == "inf" else math.sqrt(math.fsum(v * v for v in local))
    return {
        "local": local,
        "global": float(d["gradlab"][0]),
        "reference": float(d["reference"]),
        "combined": combined,
    }


def shard_norm_figure(summary: dict) -> Figure:
    """Bars: each rank's shard norm, the global norm, for the 2-norm and the inf-norm."""
    fig = new_figure(7.0, 3.0)
    axes = fig.subplots(1, 2)
    for ax, (key, title) in zip(axes, (("2", "2-norm"), ("inf", "inf-norm")), strict=True):
        d = shard_norms(summary, key)
        names = [f"rank {r}\nshard" for r in range(len(d["local"]))] + ["global"]
        values = [*d["local"], d["global"]]
        colours = [NONE] * len(d["local"]) + [KEEP]
        bars = ax.bar(names, values, color=colours)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(
                f"{v:.3g}",
                (bar.get_x() + bar.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize=9,
            )
        rule = "max of the shards" if key == "inf" else "√(sum of squares)"
        ax.axhline(d["combined"], color=CLIP, linestyle="--", label=rule)
        ax.set_title(f"{title}: shards vs the whole")
        ax.set_ylim(0, 1.45 * max(values))
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(axis="x", visible=False)
    return fig


# ------------------------------------------------------------- the explorable

#: The cost formulas in JavaScript: the same as ring_allreduce_seconds and
#: recursive_doubling_seconds (tests run them in node and compare).
COST_JS = r"""
function ringSeconds(n, bytes, alpha, bw) {
  return 2 * (n - 1) * alpha + 2 * (n - 1) / n * bytes / bw;
}
function rdSeconds(n, bytes, alpha, bw) {
  var rounds = n > 1 ? Math.ceil(Math.log2(n)) : 0;
  return rounds * (alpha + bytes / bw);
}
function fmt3(x) {
  var s = x.toPrecision(3);
  return s.indexOf(".") >= 0 && s.indexOf("e") < 0 ? s.replace(/\.?0+$/, "") : s;
}
function fmtSeconds(t) {
  if (t === 0) { return "0 s"; }
  var units = [["s", 1], ["ms", 1e-3], ["µs", 1e-6]];
  for (var i = 0; i < units.length; i++) {
    if (t >= units[i][1]) { return fmt3(t / units[i][1]) + " " + units[i][0]; }
  }
  return fmt3(t / 1e-9) + " ns";
}
"""

_FIGURE_JS = r"""
(function (root) {
  var cfg = JSON.parse(root.querySelector(".glar-config").textContent);
  var svg = root.querySelector("svg");
  var out = root.querySelector(".glar-readout");
  var W = 560, H = 300, L = 62, R = 14, T = 12, B = 40;
  var NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, text) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) { e.setAttribute(k, attrs[k]); }
    if (text !== undefined) { e.textContent = text; }
    svg.appendChild(e);
    return e;
  }
  function val(p) { return parseFloat(root.querySelector('input[data-param="' + p + '"]').value); }
  var xmin = cfg.min_log2, xmax = cfg.max_log2, ymin = -7, ymax = 2;
  function X(log2n) { return L + (log2n - xmin) / (xmax - xmin) * (W - L - R); }
  function Y(t) {
    var l = Math.log10(Math.max(t, 1e-12));
    l = Math.min(Math.max(l, ymin), ymax);
    return T + (ymax - l) / (ymax - ymin) * (H - T - B);
  }
  function draw() {
    var log2n = val("log2n"), params = Math.pow(10, val("log10params"));
    var alpha = val("alpha_us") * 1e-6, bw = val("bandwidth_gbs") * 1e9;
    var gbytes = params * cfg.bytes_per_param, dbytes = cfg.decision_bytes;
    var n = Math.pow(2, log2n);
    root.querySelectorAll("output").forEach(function (o) {
      var inp = root.querySelector("#" + o.getAttribute("for"));
      var v = parseFloat(inp.value), p = inp.getAttribute("data-param");
      o.textContent = p === "log2n" ? String(Math.pow(2, v)) :
        p === "log10params" ? "1e" + v : String(v);
      inp.setAttribute("aria-valuetext", o.textContent);
    });
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    for (var e = ymin; e <= ymax; e++) {
      var ye = Y(Math.pow(10, e));
      el("line", {x1: L, x2: W - R, y1: ye, y2: ye, stroke: "#ddd"});
      el("text", {x: L - 6, y: ye + 4, "text-anchor": "end", "font-size": 11},
         fmtSeconds(Math.pow(10, e)));
    }
    for (var k = xmin; k <= xmax; k += 2) {
      el("text", {x: X(k), y: H - B + 16, "text-anchor": "middle", "font-size": 11},
         String(Math.pow(2, k)));
    }
    el("text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", "font-size": 12},
       "ranks N (log scale)");
    var curves = [
      ["gradients, ring", function (m) { return ringSeconds(m, gbytes, alpha, bw); },
       cfg.colours.gradients, "none"],
      ["8 B decision, ring", function (m) { return ringSeconds(m, dbytes, alpha, bw); },
       cfg.colours.ring, "7 4"],
      ["8 B decision, recursive doubling", function (m) { return rdSeconds(m, dbytes, alpha, bw); },
       cfg.colours.rd, "2 3"]
    ];
    curves.forEach(function (c, i) {
      var d = "";
      for (var s = xmin; s <= xmax + 1e-9; s += 0.25) {
        var m = Math.round(Math.pow(2, s));
        d += (d ? "L" : "M") + X(s).toFixed(1) + "," + Y(c[1](m)).toFixed(1);
      }
      el("path", {d: d, fill: "none", stroke: c[2], "stroke-width": 2.5, "stroke-dasharray": c[3]});
      var yl = T + 12 + 16 * i;
      el("line", {x1: L + 10, x2: L + 38, y1: yl, y2: yl, stroke: c[2], "stroke-width": 2.5,
                  "stroke-dasharray": c[3]});
      el("text", {x: L + 44, y: T + 16 + 16 * i, "font-size": 11}, c[0]);
      el("circle", {cx: X(log2n), cy: Y(c[1](n)), r: 4, fill: c[2], stroke: "#000"});
    });
    el("line", {x1: X(log2n), x2: X(log2n), y1: T, y2: H - B, stroke: "#000",
                "stroke-dasharray": "1 3"});
    var g = ringSeconds(n, gbytes, alpha, bw), r = ringSeconds(n, dbytes, alpha, bw);
    var q = rdSeconds(n, dbytes, alpha, bw);
    root.setAttribute("data-gradients", g);
    root.setAttribute("data-decision-ring", r);
    root.setAttribute("data-decision-rd", q);
    out.textContent = "N = " + n + ": all-reducing the gradients (" +
      (gbytes / 1e9).toPrecision(3) +
      " GB) takes " + fmtSeconds(g) + "; the 8-byte decision " + fmtSeconds(r) +
      " by a ring (" + (100 * r / g).toPrecision(2) + "% of the gradients' time), " +
      fmtSeconds(q) + " by recursive doubling. Each extra collective adds its latency again.";
  }
  root.querySelectorAll("input").forEach(function (i) { i.addEventListener("input", draw); });
  draw();
})
"""

_CSS = (
    ".glar{font-family:system-ui,sans-serif;max-width:600px;margin:1em 0}"
    ".glar svg{width:100%;height:auto;background:#fff}"
    ".glar label{display:flex;align-items:center;gap:.5em;margin:.2em 0}"
    ".glar label span{min-width:13em}.glar input{flex:1}"
    ".glar output{min-width:4em;font-variant-numeric:tabular-nums}"
    ".glar-readout{font-size:.95em}"
)

_counter = itertools.count(1)


def _slider(uid: str, param: str, label: str, lo: float, hi: float, step: float, value: float):
    """A range input; its range is widened to hold a ``value`` outside ``[lo, hi]``."""
    lo, hi = min(lo, value), max(hi, value)
    sid = f"{uid}-{param}"
    return (
        f'<label for="{sid}"><span>{html.escape(label)}</span>'
        f'<input type="range" id="{sid}" data-param="{param}" min="{lo:g}" max="{hi:g}" '
        f'step="{step:g}" value="{value:g}"><output for="{sid}"></output></label>'
    )


def allreduce_cost_html(
    n_ranks: int = 1024,
    params: float = 1e9,
    link: Link = HYPOTHETICAL_LINK,
    bytes_per_param: int = 2,
    max_ranks: int = 16384,
    uid: str | None = None,
) -> DirectHTML:
    """The alpha-beta cost of all-reducing the gradients vs an 8-byte decision.

    Sliders: the number of ranks (powers of two, 2 to ``max_ranks``), the model size
    (powers of ten, 1e6 to 1e12, at ``bytes_per_param`` bytes a gradient entry), the
    latency (1 to 50 µs) and the bandwidth (1 to 400 GB/s). A starting value outside a
    slider's range widens that range to hold it (one rank, NVLink's 900 GB/s, 1e13
    entries); the ranks and the model size must still be a power of two and of ten.
    """
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive int, got {n_ranks!r}")
    if isinstance(max_ranks, bool) or not isinstance(max_ranks, int) or max_ranks < 2:
        raise ValueError(f"max_ranks must be an int >= 2, got {max_ranks!r}")
    log2n, max_log2 = math.log2(n_ranks), math.log2(max(max_ranks, n_ranks))
    if not (log2n.is_integer() and max_log2.is_integer()):
        raise ValueError(
            f"n_ranks and max_ranks must be powers of two (the slider's steps), "
            f"got {n_ranks!r} and {max_ranks!r}"
        )
    if not (isinstance(params, int | float) and params > 0 and math.isfinite(params)):
        raise ValueError(f"params must be a positive number, got {params!r}")
    log10p = math.log10(params)
    if not (abs(log10p - round(log10p)) < 1e-9 and 0 <= round(log10p) <= 15):
        raise ValueError(f"params must be a power of ten from 1 to 1e15, got {params!r}")
    log10p = round(log10p)
    if uid is None:
        uid = f"glar-{next(_counter)}"
    config = {
        "min_log2": int(min(1, log2n)),
        "max_log2": int(max_log2),
        "bytes_per_param": bytes_per_param,
        "decision_bytes": DECISION_BYTES,
        "colours": {"gradients": PALETTE["none"], "ring": PALETTE["clip"], "rd": PALETTE["keep"]},
    }
    alpha_us = link.alpha_s * 1e6
    gbs = link.bandwidth_Bps / 1e9
    sliders = (
        _slider(uid, "log2n", "ranks N", 1, max_log2, 1, log2n)
        + _slider(uid, "log10params", "gradient entries", 6, 12, 1, float(log10p))
        + _slider(uid, "alpha_us", "latency α per message (µs)", 1, 50, 1, alpha_us)
        + _slider(uid, "bandwidth_gbs", "bandwidth β (GB/s)", 1, 400, 1, gbs)
    )
    text = (
        f'<div class="glar" id="{uid}" role="group" aria-label="All-reduce cost model">'
        f"<style>{_CSS}</style>"
        '<p class="glar-caption">Time of one all-reduce in the alpha-beta model, against '
        "the number of ranks (both axes logarithmic): the gradients by a ring (grey), "
        "an 8-byte decision (a norm and a non-finite flag) by a ring (orange, dashed) and "
        "by recursive doubling (blue, dotted). The dots mark the chosen N. The starting "
        "link figures are hypothetical round numbers.</p>"
        f"{sliders}"
        '<svg role="img" aria-label="cost curves"></svg>'
        '<p class="glar-readout" aria-live="polite">This figure needs JavaScript '
        "(in JupyterLab: run the cell or trust the notebook).</p>"
        f'<script type="application/json" class="glar-config">{json.dumps(config)}</script>'
        f"<script>{COST_JS}\n{_FIGURE_JS}"
        f"(document.getElementById({json.dumps(uid)}));</script>"
        "</div>"
    )
    return DirectHTML(text, "allreduce-cost")
