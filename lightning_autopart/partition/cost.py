"""The planner's cost model: time and memory of a pipeline stage, and the step time of a whole partition.

Notation: ``L`` blocks; global batch ``B``; ``r`` replicas; pipeline depth ``S``; ``v`` chunks per rank (2 for
Interleaved1F1B, else 1); ``V = S*v`` virtual stages; ``M`` micro-batches of ``m = B / (r*M)`` samples. A
(virtual) stage ``k`` holds blocks ``[i, j)`` and sits at position ``p = k % S``.

Per block at ``m`` samples, read off its cost curve (see [Note: cost curves] in records.py)::

    f_k, b_k     forward and backward time (the last block carries the loss that training_step computes);
                 b_k + (M - 1)/M * g_k, g_k the block's gradient accumulation ([Note: gradient accumulation]
                 in profile/step.py; all of g_k when gradients outlive the step)
    a_k          bytes saved for backward,   x_k  bytes of backward's transient peak (gradients, temporaries)
    c_k          bytes crossing the cut after block k,   c_{-1} = c_in = the model's input bytes
    o_k          the optimizer step over the block's parameters (once per step, independent of m)

Per stage, with prefix sums (and a sparse table for the range maximum) so that every interval costs O(1)::

    F = sum f_k, Bw = sum b_k, O = sum o_k                    over k in [i, j)
    static = params + grads + optimizer + buffers            (+ a full copy of each tied parameter the
                                                              stage uses but whose owner block it lacks)
    W = in_flight * sum w_k                                     (autocast's weight copies the backward keeps,
                                                              "-mixed": [Note: weight casts]; checkpointing:
                                                              0, the recompute's are in sum a_k)
    in_flight = 1 (S = 1) | M (GPipe) | min(S - p, M) (1F1B)
              | the chunk's most over its rank's backwards (Interleaved1F1B, [Note: interleaved in flight])
    X = max_k (sum_{i..k} a + x_k) - sum a                      (one micro-batch's backward at a time; block k's
                                                              meets the activations of blocks i..k only:
                                                              [Note: backward's peak] in tables.py)
    Y = grads * optimizer transient factor                      (the optimizer step's temporaries, after backward)
    D = F(i, j)                                                 (what the forward holds of the saves of its
                                                              dead parts, freed before backward: [Note: a
                                                              dead part's saves])
    E = max(X, D), or fresh_excess(...) if fresh                (gradients not yet made at the peak: [Note:
                                                              fresh gradients] in fresh.py, D at the
                                                              forward's end; u = sum a_k + sum w_k: a
                                                              backward frees both)
    memory_off = static + P + max(in_flight * sum a_k + E_off + Q_off + W, Y)
    memory_on  = static + P + max(in_flight * c_{i-1} + sum a_k + sum w_k + E_on + Q_on, Y)  (u = c_{i-1};
                                                              keep only the stage input per micro-batch,
                                                              recompute one micro-batch at a time)
    P, Q = the batch and the pipeline's buffers, kept and in flight ([Note: pipeline buffers])
    checkpoint = memory_off > limit (and then Bw += F);  feasible iff chosen memory <= limit = usable, or a
                                                              chunk's share of it ([Note: chunk shares])
    p2p(bytes, link) = bytes / bw_link * 1e6 + latency_us
    h = 2 * action_us if V > 1 else 0                           (host time of a micro-batch's two actions; a
                                                                single stage runs its micro-batches in its own
                                                                loop, no schedule, no messages)
    G = sum g_k (+ sum gf_k if checkpoint)                      (the blocks' own host time where the host runs
                                                                ahead of the device, forward gf_k + backward;
                                                                0 where the host does the math, see [Note: host
                                                                and device] in profile/cuda_clock.py)
    C = F + Bw + h (host does the math: CPU) | max(F + Bw, h + G) (host runs ahead of the device)
    t = C + [p2p(c_{j-1}) if j < L] + [p2p(c_{i-1}) if i > 0]          (per micro-batch)
    a = 0 if r == 1 else 2(r-1)/r * grad_bytes / bw_allreduce * 1e6 + 2(r-1) * latency_us
    w0 = K * t + v * (a + O) + H,   K = v*M + S - 1,   H = step_us (0 where the host runs ahead)
    w = max(w0 + q D + (1 - q) max(0, D + K (h + G) + H - w0), D_w)
    D, D_w = the loader's time for a replica's B/r samples without workers, 0 | 0, its time over W workers
    q = 1 / (steps between two reads of a device value) (0: never; 1 where the host does the math)

[Note: weight casts] Under a "-mixed" precision, autocast copies each weight to low precision in the forward,
and the backward keeps the copy until the weight's gradient is made; the copies are gone by the optimizer step,
so they belong to the forward/backward term, not to the state. Lightning runs autocast with its cache off
(``cache_enabled=False``), so each micro-batch's forward makes its own copies: they are priced per micro-batch
in flight, like activations (a single stage runs one at a time). Counted as state once, they over-predicted
optimizer-bound steps (`bench/step_peak.py --precisions bf16-mixed`: ConvNeXt 1.100, a wide Llama at one
sample 1.092; now 1.000 and 1.000) and under-predicted GPipe ranks, whose micro-batches are all in flight
(`bench/pipeline_peak.py --model llama --precision bf16-mixed`: 0.905; now 1.001). ``w_k`` is what the
backward keeps: a copy it does not need (a first layer's, a bias's) dies with its operation. A backward frees
its copies with its activations, for fresh gradients to take their place (``u`` counts them). MLP GPipe ranks:
1.157 and 1.088 before both, 1.031 and 1.014 after. A checkpointed stage keeps none in flight: the recompute
makes one micro-batch's again, priced with its activations.

[Note: a dead part's saves] A part of the forward whose outputs nothing differentiates (a head the loss skips;
a value the model computes and never uses, as CANINE's classifier leaves its upsampled characters) gets no
gradient: its parameters no gradient nor optimizer state ([Note: unreached gradients] in fresh.py), and its
saves go with its graph when its outputs are dropped, before backward, so they are no activations. But the
forward holds them until then: a model's output until the loss is computed, a local until the model's forward
returns. Each block records them (``dropped_bytes``: what dropping its dead outputs frees; all it saves, its
inputs too, where it differentiates nothing, ``forward_only``, and its transient is its forward's peak), and
``F(i, j)`` (:class:`~.tables.ForwardPeak`) is the most a micro-batch's forward holds of them beyond the
activations: all of them at the forward's end, or those made before a forward-only block while it peaks, with
the activations up to it. ``E`` takes the larger of ``X`` and ``D``; a fresh stage adds ``D`` to the forward's
end, where a single stage holds last step's gradients (a checkpointed forward saves none). CANINE's
classification, whose upsampling and last character encoder nothing reads, read 1.228 of plain Lightning's step
peak (``bench/step_peak.py``: their gradients and optimizer state priced) and 0.872 with them dropped but the
saves not held; 0.982 with both (float32 and bf16-true).

[Note: pipeline buffers] Besides its state and activations, a rank holds what the step moves:

- the replica's whole batch, labels too (``B/r`` samples of ``batch_bytes``, at least the model's inputs):
  Lightning moves it to every rank's device and it lives through the step; the first stage's micro-batches
  are views of it. An interleaved rank holds it once: its first chunk counts it (``first``), the others none
  (their saved inputs are views of their receive buffers);
- torch.distributed.pipelining's receive buffers, made at the first step, one per micro-batch, and kept: the
  activations into a stage after the first (``recv_i = c_{i-1}``) and the gradients into a stage before the
  last (``send_j = c_{j-1}``; every value crossing a cut gets one, see [Note: wire format] in runtime/wire.py);
- each in-flight micro-batch's output, which the schedule keeps until its backward (``held_j``: the share
  of ``c_{j-1}`` block ``j-1`` does not save itself); not the last stage's, which the runtime drops once the
  loss is computed, leaving what the loss saves of it to the loss ([Note: the last stage's outputs]).

The activations count some of it already: what block ``i`` saves of its input (``alias_i``) is the receive
buffer or the batch, and so is every input a checkpointed stage keeps. An output the stage received as it is
(made before block ``i``, sent on untouched: ViT-MAE's images, which its loss reads at the end) is too: the
held part of it (``pass_ij``, :meth:`~.tables.SizeTables.passed_through`) is its receive buffer or the batch.
So::

    P = [first] max(batch_bytes * (B/r), M * c_{-1}) + msg * (recv_i + send_j)
    Q_off = in_flight * (held_j - pass_ij - alias_i),   Q_on = in_flight * (held_j - pass_ij - c_{i-1}),   P + Q >= 0

with ``msg = M``, or ``2M - 1`` under Interleaved1F1B: torch's runtime for several chunks per rank waits on its
sends only at the step's end, so each finished micro-batch's output and input gradient stay until then (a
chunk judged alone counts ``M - 1`` of them; its rank's peak counts those finished by then, [Note: a rank's
chunks] in ranks.py). Interleaved: 1.16-1.17 of each rank's measured peak before, 1.01-1.02 since.

Each rank's measured step peak against its stage's predicted memory, 2-stage MLP on 2 gloo ranks
(``bench/pipeline_peak.py``): 0.93-0.97 under 1F1B and 1.08-1.10 under GPipe without them (and with ``D``
capped by ``X``); 1.01-1.02 with them, and 0.985-1.00 on a Llama and a GPT-2 (``--model``). The floor
``M * c_{-1}`` (every micro-batch's input) keeps ``P + Q >= 0``, which the search's memory bounds need
(``pass_ij <= held_j``). Crediting ``pass_ij`` took ViT-MAE's first rank from 1.10 (1F1B) and 1.23
(Interleaved1F1B) of its measured peak to 1.00 and 1.11. The finished micro-batches' sends kept under
Interleaved1F1B are credited the larger ``relay_ij`` (:meth:`~.tables.SizeTables.relayed_through`): what the
stage sends as received whether or not block ``j-1`` saves it, ``(msg - M) * relay_ij`` off ``P``. A value
block ``j-1`` saves as it passes it on is an activation, not a held output (its ``saved_output_share``).
Counting the batch once per rank, not ``1/v`` per chunk above that floor, took the measured peaks of vision
models' interleaved ranks from 0.74-0.97 of the prediction to 0.94-1.02 (``bench/pipeline_sweep.py``).

and the step time of a partition is ``T = max over virtual stages of w`` (a synchronous clock: every tick lasts
as long as the slowest stage; a stage's all-reduce follows its last backward, its optimizer step follows that).
``action_us`` (per forward or backward action of a stage: the schedule's bookkeeping, autograd's entry, posting
and completing its messages) and ``step_us`` (per step, outside the pipeline: the loss's broadcast, the stop
check) are the cluster's host overheads (see [Note: host overhead]). Links and all-reduce groups are intra- or
inter-node per the rank layout (:mod:`.placement`). A device's peak memory is the sum over the chunks it holds
(one chunk unless interleaved). Memory is compared in exact integer bytes (``memory <= limit``), so
feasibility never depends on rounding.

[Note: loader in the step] Every rank of a replica fetches the replica's ``B/r`` samples each step (the first
stage its inputs, the last its targets). Without loader workers the training process makes the batch. After a
step that read a device value back (Lightning's progress bar reads the logged loss once a step) the device
waits for it, so the time adds to every stage's term, ``D``; after a step that did not, the host makes the next
batch while the device computes, and the step takes the longer of the device's term and the host's, the fetch
plus the launches of the step's ``K`` ticks (``q`` from [Note: reads back] in ``profile/readback.py``);
with ``W`` workers a batch comes every ``fetch / W`` at best, a floor on the step, ``D_w``, where the host runs
ahead of a device. Where the host does the math (CPU), the workers take the cores the math needs: a 2-core
run of a 2-layer MLP stepped 86-96 ms with 2 workers against 75-83 ms with none, so the time adds there as
without workers. The fetch time is
measured on this host ([Note: loader time] in :mod:`lightning_autopart.profile.loader`); a loader that was not
timed (an iterable dataset, a profile made from shapes) adds nothing.

[Note: host overhead] On CPU (gloo) the host runs every action itself: a 2-stage MLP step measured 23 ms against
14 ms of math and messages priced, the rest being ~80 us of torch.distributed.pipelining bookkeeping and 0.2-0.3
ms of gloo posting per action, the stage's math slowed by the other rank sharing the cores, and ~3-5 ms of
Lightning's per-step work. The CPU probe measures the per-action and per-step host time
(:func:`~lightning_autopart.profile.calibrate.probe_host`), and on CPUs the profile and the probe run while the
other ranks of the machine compute ([Note: planning under load] in :mod:`lightning_autopart.lightning.load`).
Under the strategy, rank 0 and rank 1 also run a short synthetic pipeline sized like the model's stages, and
``action_us`` covers what its micro-batches took beyond their math and messages ([Note: pipeline probe] in
:mod:`lightning_autopart.profile.pipeline_probe`).
Lightning's own loop (hooks, replayed ``self.log``) is the user's code and is not priced; its data fetch is
([Note: loader in the step]). GPU specs
carry estimates (not measured on a GPU: a one-GPU machine runs no pipeline); there a micro-batch's host time
counts only where it exceeds the device's, and the step's fixed work hides behind the queued kernels.

:func:`~.scoring.evaluate` scores any given partition with exactly these formulas; the DP (:mod:`.dp`) evaluates
the same expressions in the same order, so its optimum and a brute force over ``evaluate`` agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_autopart.partition.configs import CHUNKS, Config, check_config, in_flight
from lightning_autopart.partition.fresh import fresh_excesses, fresh_stages, sent_backs
from lightning_autopart.partition.placement import link_pattern
from lightning_autopart.partition.ranks import ChunkParts, with_first_backward
from lightning_autopart.partition.tables import CostTables, SizeTables
from lightning_autopart.partition.tied import TiedCopy

__all__ = [
    "CHUNKS",
    "INF",
    "Config",
    "ConfigCosts",
    "CostTables",
    "StageCost",
    "TiedCopy",
    "check_config",
    "config_costs",
    "in_flight",
    "stage_cost",
]

INF = float("inf")


@dataclass(slots=True)
class ConfigCosts:
    """Everything per (virtual) stage that a configuration fixes: clock ticks, in-flight counts, links."""

    cfg: Config
    m: int
    v: int
    ticks: int
    checkpointing: bool
    pf: list[float]
    pb: list[float]
    #: The tables of the micro-batch size ``m``.
    at: SizeTables
    #: Per virtual stage: in-flight micro-batches, p2p arrays of its input and output links, all-reduce terms.
    in_flight: list[int] = field(default_factory=list)
    p2p_in: list[list[float]] = field(default_factory=list)
    p2p_out: list[list[float]] = field(default_factory=list)
    ar_coef: list[float] = field(default_factory=list)
    ar_const: list[float] = field(default_factory=list)
    #: Prefix sums of the blocks' host time (forward and backward; forward alone), zeros where the host does
    #: the math (see ``G`` in the module docstring).
    host_fb: list[float] = field(default_factory=list)
    host_f: list[float] = field(default_factory=list)
    #: Host time of one micro-batch's two actions, whether it adds to the math (CPU), and the step's host time.
    host: float = 0.0
    host_adds: bool = False
    step_host: float = 0.0
    #: The loader's time that adds to the step (``q D``), the fetch that may overlap the device (``D`` where
    #: ``q < 1``) and the share of steps it does (``1 - q``), and the least the step may take (``D_w``); see
    #: [Note: loader in the step].
    data: float = 0.0
    data_open: float = 0.0
    data_share: float = 0.0
    data_floor: float = 0.0
    #: Per virtual stage: its gradients do not exist at its activations' peak ([Note: fresh gradients] in
    #: fresh.py).
    fresh: list[bool] = field(default_factory=list)
    #: Whether a fresh stage's forward ends with last step's gradients (a moment of [Note: fresh gradients]):
    #: plain Lightning's step keeps them through the forward; a pipelined step drops them first.
    capped: bool = True
    #: Per virtual stage: the replica's batch bytes it holds (``P``): all on a rank's first chunk, none after.
    batch: list[int] = field(default_factory=list)
    #: ``held_j`` per boundary: a single stage runs no schedule, which would keep the model's outputs.
    held: list[int] = field(default_factory=list)
    #: Micro-batches of each cut a chunk's messages keep: its receive buffers, and under Interleaved1F1B the
    #: sends torch's runtime waits on only at the step's end ([Note: pipeline buffers]).
    messages: int = 0
    #: Per virtual stage: the bytes it may use ([Note: chunk shares] in tables.py).
    limit: list[int] = field(default_factory=list)


def config_costs(tables: CostTables, cfg: Config, batch_size: int, checkpointing: bool = True) -> ConfigCosts:
    """Precompute the per-stage constants of ``cfg`` (see the module docstring for the formulas)."""
    cl = tables.cluster
    s, r, v = cfg.stages, cfg.replicas, cfg.chunks
    m = batch_size // (r * cfg.micro_batches)
    at = tables.at(m)
    mb = cfg.micro_batches  # every micro-batch but the first adds into the gradients the first made
    share = 1.0 if tables.persistent_grads else (mb - 1) / mb
    cc = ConfigCosts(cfg, m, v, cfg.ticks, checkpointing, at.pf, tables.accumulating_pb(m, share), at)
    pat = link_pattern(s, r, cl.devices_per_node, cfg.layout)
    intra, inter = tables.p2p(m, True), tables.p2p(m, False)
    out = [intra if x else inter for x in pat.p2p_intra]
    cc.in_flight = [in_flight(cfg.schedule, s, k % s, cfg.micro_batches, k // s) for k in range(s * v)]
    cc.p2p_out = out * v
    cc.p2p_in = [out[p - 1] for p in range(s)] * v
    cc.fresh = fresh_stages(tables, cfg) * v
    cc.capped = not cfg.pipelined
    cc.held = at.held if cfg.pipelined else [*at.held[:-1], 0]
    cc.messages = cfg.messages
    cc.limit = tables.limits(cfg, m)
    # at least every micro-batch's input, which the first stage's in-flight inputs (Q) are views of
    whole = tables.batch_bytes(m, cfg.micro_batches)
    cc.batch = [whole if k < s else 0 for k in range(s * v)]
    cc.host = 2 * cl.action_us if cfg.pipelined else 0.0  # one stage runs its micro-batches in its own loop
    fetch, q, cc.data_floor = tables.loader_us(batch_size // r)
    cc.data, cc.data_open, cc.data_share = q * fetch, (fetch if q < 1 else 0.0), 1.0 - q
    cc.host_adds, cc.step_host = not cl.async_host, cl.step_host_us
    zero = [0.0] * (tables.num_blocks + 1)
    cc.host_fb, cc.host_f = (zero, zero) if cc.host_adds else (tables.host_fb, tables.host_f)
    if r == 1:
        cc.ar_coef = [0.0] * (s * v)
        cc.ar_const = [0.0] * (s * v)
    else:
        ci = 2 * (r - 1) / r / cl.intra_allreduce_bw * 1e6
        ce = 2 * (r - 1) / r / cl.inter_allreduce_bw * 1e6
        cc.ar_coef = [ci if x else ce for x in pat.allreduce_intra] * v
        cc.ar_const = [2 * (r - 1) * cl.latency_us] * (s * v)
    return cc


@dataclass(frozen=True, slots=True)
class StageCost:
    """Time and memory of one (virtual) stage under one configuration."""

    index: int
    block_start: int
    block_end: int
    fits: bool
    checkpoint: bool
    fwd_us: float
    bwd_us: float
    p2p_us: float
    allreduce_us: float
    #: The optimizer step over the stage's parameters, once per step.
    optimizer_us: float
    #: Host time per micro-batch not hidden behind the math (``C - F - Bw``, see [Note: host overhead]).
    host_us: float
    #: Per-micro-batch time ``t`` and the stage's step-time term ``w = K*t + v*(a + O) + H``.
    time_us: float
    term_us: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    #: Activations at the peak: the in-flight micro-batches', less what a backward has freed by then where the
    #: gradients not yet made outweigh its transient ([Note: fresh gradients] in fresh.py).
    activation_bytes: int
    #: Backward's transient peak (one micro-batch's gradients and temporaries), less the stage's gradients
    #: that do not exist yet at the peak (see [Note: fresh gradients] in fresh.py).
    transient_bytes: int
    in_flight: int
    memory_bytes: int
    limit_bytes: int
    param_count: int
    #: The loader's share of ``term_us``: its time without workers (what of it the device's work does not
    #: hide), or what its workers' pace adds.
    data_us: float = 0.0
    #: The batch and the pipeline's buffers at the activations' peak, ``P + Q`` (see [Note: pipeline buffers]).
    io_bytes: int = 0
    #: What feasibility judges against ``limit_bytes``: ``memory_bytes``, or for a chunk of an interleaved rank
    #: its bound alone (its most micro-batches in flight and its own backward), where ``memory_bytes`` is its
    #: share of the rank's peak ([Note: a rank's chunks] in ranks.py).
    bound_bytes: int = 0
    parts: ChunkParts | None = None


def stage_cost(tables: CostTables, cc: ConfigCosts, k: int, i: int, j: int) -> StageCost:
    """Cost of virtual stage ``k`` holding blocks ``[i, j)``; when it does not fit, the smaller memory is shown."""
    v, at, cap = cc.v, cc.at, cc.limit[k]
    tp, tg, to, tn = tables.tied_extra(i, j)
    static, grads = tables.state(cc.cfg.replicas)  # [Note: unreached gradients] in fresh.py
    st = static[j] - static[i] + tp + tg + to
    a_sum = at.acts[j] - at.acts[i] + at.shared[i]
    trans = at.transient(i, j)
    dropped = at.forward(i, j)  # [Note: a dead part's saves]
    unit_casts = tables.casts[j] - tables.casts[i]  # [Note: weight casts]: per micro-batch in flight
    grad = grads[j] - grads[i] + tg
    y = int(grad * tables.opt_transient)
    infl, mb = cc.in_flight[k], cc.cfg.micro_batches
    casts_off = infl * unit_casts  # checkpointing keeps none in flight: the recompute makes its own, saved
    act_off = infl * a_sum
    act_on = infl * at.stage_input[i] + a_sum + unit_casts
    # [Note: pipeline buffers]: P, and Q with the saved inputs (all of them when checkpointing) in P already.
    sent = at.recv[i] + at.send[j]  # a micro-batch's messages over both cuts
    passed = min(cc.held[j], at.passed_through(i, j))  # its input, sent on as is: no copy held
    relayed = at.relayed_through(i, j)  # and, saved or not, no copy kept with its finished sends
    held = cc.batch[k] + cc.messages * sent - (cc.messages - mb) * relayed
    kept_out = cc.held[j] - passed
    q_run = infl * kept_out
    q_off, q_on = q_run - infl * at.alias[i], q_run - infl * at.stage_input[i]
    backs = (0, 0)
    if v == 1 and at.recv[i]:  # earlier input gradients held for their sends ([Note: input gradients in flight])
        unit = a_sum + unit_casts + kept_out - at.alias[i]
        gpipe = cc.cfg.schedule == "GPipe"
        backs = sent_backs(at.recv[i], unit, kept_out, at.stage_input[i], infl, mb, gpipe, cc.fresh[k])
    # what the peak adds to the units in flight ([Note: backward's peak] in tables.py; [Note: fresh
    # gradients] in fresh.py)
    e_off, e_on = max(trans, dropped) + backs[0], trans + backs[1]
    if cc.fresh[k]:
        e_off, e_on = fresh_excesses(
            trans, at.fresh_transient(i, j), grad, cc.capped, a_sum + unit_casts, at.stage_input[i], infl > 1, backs,
            dropped,
        )  # fmt: skip
    fits = True
    if st + held + max(act_off + e_off + q_off + casts_off, y) <= cap:
        ck, act, e, q = False, act_off, e_off, q_off
    elif cc.checkpointing and st + held + max(act_on + e_on + q_on, y) <= cap:
        ck, act, e, q = True, act_on, e_on, q_on
    else:
        fits = False
        ck = cc.checkpointing and act_on + e_on + q_on < act_off + e_off + q_off + casts_off
        act, e, q = (act_on, e_on, q_on) if ck else (act_off, e_off, q_off)
    casts = 0 if ck else casts_off
    excess = max(0, -e)  # fresh gradients beyond the transient: activations (then casts) freed by then
    freed = min(excess, act)
    pf, pb = cc.pf, cc.pb
    f = pf[j] - pf[i]
    fb = f + (pb[j] - pb[i])
    comp = fb + f if ck else fb
    host = cc.host + (cc.host_fb[j] - cc.host_fb[i])
    if ck:
        host += cc.host_f[j] - cc.host_f[i]
    busy = comp + host if cc.host_adds else (comp if comp > host else host)
    pin = cc.p2p_in[k][i]
    pout = cc.p2p_out[k][j]
    t = busy + pin + pout
    a = cc.ar_coef[k] * grad + cc.ar_const[k] if cc.cfg.replicas > 1 else 0.0
    opt = tables.opt_us[j] - tables.opt_us[i] + tables.tied_optimizer_us(i, j)
    w0 = cc.ticks * t + v * (a + opt) + cc.step_host
    w = w0 + cc.data
    if cc.data_open:  # the fetch after a step that read nothing back overlaps the device's work
        w += cc.data_share * max(0.0, cc.data_open + cc.ticks * host + cc.step_host - w0)
    data = w - w0
    if w < cc.data_floor:
        data, w = cc.data_floor - w, cc.data_floor
    buf = tables.buffers[j] - tables.buffers[i] + casts - (excess - freed)  # weight casts in flight: buffers
    unit, kept = (at.stage_input[i], at.stage_input[i]) if ck else (a_sum, at.alias[i])  # per micro-batch
    redo = a_sum + unit_casts if ck else 0  # what one micro-batch's recompute saves
    return StageCost(
        index=k,
        block_start=i,
        block_end=j,
        fits=fits,
        checkpoint=ck,
        fwd_us=f,
        bwd_us=comp - f,
        p2p_us=pin + pout,
        allreduce_us=a,
        optimizer_us=opt,
        host_us=busy - comp,
        time_us=t,
        term_us=w,
        param_bytes=tables.params[j] - tables.params[i] + tp,
        grad_bytes=grad,
        optimizer_bytes=tables.optim[j] - tables.optim[i] + to,
        buffer_bytes=buf,
        activation_bytes=act - freed,
        transient_bytes=max(e + excess, y - act - q - casts + excess),
        in_flight=infl,
        memory_bytes=(mem := st + casts + held + max(act + e + q, y - casts)),
        limit_bytes=cap,
        param_count=tables.counts[j] - tables.counts[i] + tn,
        data_us=data,
        io_bytes=held + q,
        bound_bytes=mem,
        parts=None if v == 1 else with_first_backward(
            ChunkParts(st, cc.batch[k] + mb * sent, unit, kept_out - kept, sent - relayed, redo,
                       max(trans, dropped), y, 0 if ck else unit_casts),
            0 if cc.cfg.replicas > 1 or tables.persistent_grads else grad - tg,  # a tied copy's: there from the start
            at.fresh_transient(i, j),
        ),
    )  # fmt: skip

