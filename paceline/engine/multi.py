"""MultiEngine: one step loop over several models, each with its own Engine (runner, KV pool, scheduler).

Lanes (LANES, the default): while exactly two models are busy (no load, no debut), each one's forward runs on a
worker thread of its own with half the OpenMP threads, both at once, and the engine thread schedules, updates and sends
tokens out for whichever ends first (`_lane_step`). A step on both cores is far from twice as fast as on one at
these sizes, so side by side each model's streams wait for their own step only. Otherwise the rotation below.

A step runs one model's batch: different weights cannot share a forward pass. Which model runs is decided here,
from every model's streams at once (two engines in two processes would instead both compute at the same time and
share the cores badly):

1. A model whose streams have waited at least half the TBT goal since its last step is at risk: the one that has
   waited longest runs. This is what keeps one model's decodes from starving behind another model's prompts or
   priorities.
2. Otherwise the model holding the most urgent request (lowest priority value) runs; between equals, the one
   that has waited longest. With equal priorities this alternates the busy models step by step.

Layer-sliced steps (the default; PACELINE_SLICE=0 turns them off): a step is a generator (Engine.step_iter) that
yields between two layers of the model. While another model's streams wait, the running step is suspended at the
last layer boundary before they come due (waited SLICE_DUE x their own last step, or x their last decode step when
that last step was prompts alone, `_stream_step_s`; `_advance` judges the next layer by the one just run, and the
piece after the last layer, which holds the lm_head, by the model's last such tail), that model's step runs whole
and its tokens go out at once, and the suspended step resumes on a later call. A stream then waits for a bounded
slice of another model's long step instead of all of it: an int4 stream's usual gap (~11 ms on 2 Zen 4 cores) is
shorter than one float32 decode step (~27 ms), so unsliced no rotation could keep it. SLICE_DUE < 1 gives the
model with the short steps more of the cores while both stream; the step-time target each model's steps are cut to
counts the other models' steps run inside them (`_share_step_target`), so a model's own streams, which wait for all
of its step, keep their gap too. A step of prompts alone is cut to the model's whole target while another model
streams (its layers would otherwise be longer than the other's due interval, `_sliced_budget`), and a model loaded
on demand runs its first prompt whole, the others due only after DEBUT_DUE x their last step meanwhile. The rotation
stays on the engine thread. (Lanes were first measured 2026-11-24 08:18 UTC, one process, `/tmp` script: an int4
stream's gap beside float32 decodes was 18.8-24.2 ms at the median, no better than sliced; by 2026-11-29 float32's
gaps, not int4's, were what the rotation missed, and served lanes won: docs/multi-model.md.) A suspended step's duration
counts its own layers only. Only a model whose streams' step is shorter than the running step may preempt it
(SLICE_SHORTER), a step that nothing could preempt runs in one piece (SLICE_WHOLE), and while another model streams
a young prompt waits for a step with room for a block rather than taking its block beside decodes that already
fill the target (SLICE_DEFER_S).

Where slicing does not apply (PACELINE_SLICE=0, speculative decoding, a parallel runner, the fault injector's
hooks: `sliceable`), a stream waits for a whole step of every other busy model, so while k models have
unfinished requests and any of them has running streams, each model's step-time target (`max_step_ms`, which cuts
prompt chunks) is its own divided by k, and a step of prompts alone is capped to the tokens its share predicts
(the scheduler cuts only steps that carry a decode of their own model; a 64-token prompt alone takes 180-270 ms
for the bundled model in float32 on the old 2-core VM, 2026-11-23). A debut's first prompt is then cut to what the
target leaves beside the other models' next steps (DEBUT_STEP "fit").

A model loading on demand takes turns in the same rotation (LoadTurns): the parts of its load that hold the
interpreter or a core (building the Engine from its runtime snapshot, mapping its pages in) run on the loader
thread while the engine thread waits between two steps, each turn bounded like a step, instead of beside the
other models' steps. Beside them a load stretched the step it overlapped by 25-85 ms (the engine thread waiting
for the interpreter and a core; 2026-11-24, step log in docs/multi-model.md).

Sliced, a step whose own streams would otherwise wait longer than its model's whole step-time target lets the other
models' streams wait longer than SLICE_DUE x their step, up to SLICE_DUE_MAX x it (SLICE_SPAN, `_span_due`): the
model with the long steps (float32) gets the share of the cores that keeps its gap near its gap alone, the other one
gives up no more than that. Every model's KV pool prefault runs only while no model has work (`_pace_prefaults`).

With one model busy the pick is skipped: the single-model path costs one dict walk per step.
MultiEngine is not thread-safe; AsyncEngine calls it from its engine thread only, as it does an Engine.
"""
from __future__ import annotations

import concurrent.futures
import math
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator

from paceline.config import EngineConfig
from paceline.core.auto_batch import largest_that_fits
from paceline.core.batch_shape import BatchShape
from paceline.engine.engine import Engine, RequestOutput
from paceline.engine.prefault import set_nice
from paceline.engine.runner import ModelRunner, set_step_threads, step_threads
from paceline.sampling import SamplingParams

# Without slicing (PACELINE_SLICE=0, or an engine that cannot be sliced), how a model loaded on demand runs its first
# prompt beside other models' streams: "fit" (cut to what the step-time target leaves beside the other models' next
# steps, _foreign_step_s) or "whole" (its own token budget, uncapped: one step for a short prompt). ("left", the
# others' last steps only, measured 2026-11-24 00:21-00:31 UTC, is gone: "fit" replaced it.) Sliced, it runs whole.
DEBUT_STEP = os.environ.get("PACELINE_DEBUT_STEP", "fit")
# Layer-sliced steps (see MultiEngine._advance): PACELINE_SLICE=0 runs every step whole, as before 2026-11-24 (the A/B)
SLICE = os.environ.get("PACELINE_SLICE", "1") != "0"
# Another model's streams are due once they have waited SLICE_DUE x that model's own last step since it ended. While
# two models stream, a model then gets SLICE_DUE / (1 + SLICE_DUE) of the time inside the other's steps, and the one
# with the short steps (int4, ~11 ms) waits about SLICE_DUE x its step between two of its own. (Against the median of
# its last decode steps, 2026-11-24 05:56-05:59 UTC: a debut's first prompt got ~15 ms of every 70 ms int4 prompt
# chunk, first token 0.958 s; see docs/multi-model.md.) 0.5 rather than 1.0: in one process, the benchmark's traffic,
# no KV prefault (2026-11-24 08:31-08:35 UTC, /tmp script), int4 p99 gap 23.3 ms at 0.5 against 26.2 ms at 1.0
# (31.3 ms before SLICE_AHEAD / SLICE_SHARE), float32 139.6 against 148.1 ms (run M's 0.5 alone, without the
# shares, was worse for both: the float32 steps stretched 3x with no shorter target)
SLICE_DUE = float(os.environ.get("PACELINE_SLICE_DUE", "0.5"))
# Suspend a step at the last layer boundary before another model's streams come due, judging the next layer by the one
# just run, rather than at the first boundary after (which overshot by up to one layer: ~8 ms of a 216-token float32
# prompt chunk, 2026-11-24 08:25 UTC step log). PACELINE_SLICE_AHEAD=0: the first boundary after (the A/B)
SLICE_AHEAD = os.environ.get("PACELINE_SLICE_AHEAD", "1") != "0"
# While the first step of a model loaded on demand runs (its first prompt, whole), the other models' streams are due
# only after DEBUT_DUE x their own last step: the switch's first token waits for that step and the steps run inside
# it, and the other streams' gaps may then be a few of their own steps long (the target is their usual p99, which
# their own prompt chunks set). At SLICE_DUE the float32 debut's 64-token prompt got half the cores beside int4
# streams: first token 0.481-0.511 s (run L, 2026-11-24 06:25 UTC). PACELINE_DEBUT_DUE for the A/B
DEBUT_DUE = float(os.environ.get("PACELINE_DEBUT_DUE", "4.0"))
# A debut's first prompt lets the other models' streams wait only as long as its first token needs: their due factor
# is the least in [SLICE_DUE, DEBUT_DUE] at which the rest of its step, with their steps run inside it, is predicted
# to end DEBUT_BY_S after its request (`_debut_due`). Why: at a fixed DEBUT_DUE of 4 an int4 debut's 64-token prompt
# (50-80 ms) ran whole beside float32 streams, whose gaps then were 142-190 ms against their p99 of ~100 ms while its
# first token came 0.21-0.33 s after the request (2026-11-29 09:50 UTC switch run); at a fixed 2 a float32 debut's
# first token went past 0.5 s (run LL). 0.4 s leaves room for a prediction that falls short. 0: DEBUT_DUE alone (A/B)
DEBUT_BY_S = float(os.environ.get("PACELINE_DEBUT_BY_S", "0.4"))
# While a model loads on demand or waits for its first token, the other models' steps run their decodes only: a
# prompt of theirs under way waits (Scheduler hold_prompts). Why: a float32 debut's first prompt beside an int4 stream
# whose own prompt was in chunks ran int4 steps of a decode and 20-58 prompt tokens (35-46 ms), each counted as the
# step the int4 streams' due time is measured in (DEBUT_DUE x it), and their gaps were 94-121 ms against their p99
# of 64-71 ms (switch #1 of runs RRR and SSS, 2026-11-29). PACELINE_HOLD_PROMPTS=0: prompts chunked as before (A/B)
HOLD_PROMPTS = os.environ.get("PACELINE_HOLD_PROMPTS", "1") != "0"
# Sliced, a step of prompts alone is cut to its own whole step-time target while another model streams (_sliced_budget);
# PACELINE_SLICE_PROMPT_CAP=0: uncut, as before (the A/B)
SLICE_PROMPT_CAP = os.environ.get("PACELINE_SLICE_PROMPT_CAP", "1") != "0"
# Sliced, the step-time target's share counts the other models' steps run inside a step (_share_step_target);
# PACELINE_SLICE_SHARE=0: one share per busy model, as before (the A/B)
SLICE_SHARE = os.environ.get("PACELINE_SLICE_SHARE", "1") != "0"
# Sliced, the boundary after a step's last layer is judged by the model's last tail (that boundary to the step's end:
# final norm, lm_head, sampling, the scheduler's update), not by the layer just run: the float32 tail, its lm_head
# over 113 MB of weights, took 3.5-6.9 ms (p50 4.0), four to eight of its decode layers, and ran past the int4
# streams' due time in most of their gaps over 17 ms (2026-11-24 13:02 UTC step log, docs/multi-model.md). Only for
# models whose steps are shorter than this one's (see _advance). On by default again since 2026-11-24 16:00 UTC, with
# SLICE_SPAN (off 14:20-16:00 UTC: alone, with SLICE_STREAM_DUE, int4's p99 gap met 1.2x its alone figure in one of
# two served runs, but float32's fell to 1.48-2.48x; docs/multi-model.md). PACELINE_SLICE_TAIL=0: off (the A/B)
SLICE_TAIL = os.environ.get("PACELINE_SLICE_TAIL", "1") != "0"
# When another model's last step was prompts alone (it gave its streams their first token), they are due after
# SLICE_DUE x its last step that ran decodes (or the step-time model's decode step), not x that prompt step: their
# next step is a decode, and due after half a 60-200 ms prompt step their first gap was 22-50 ms, the largest int4
# gaps of the run (same step log). On by default like SLICE_TAIL (PACELINE_SLICE_STREAM_DUE=0: off, the A/B)
SLICE_STREAM_DUE = os.environ.get("PACELINE_SLICE_STREAM_DUE", "1") != "0"
# Sliced, a step whose own streams would otherwise wait longer than the model's whole step-time target (its gap
# alone) lets the other models' streams wait longer than SLICE_DUE x their step, up to SLICE_DUE_MAX x it
# (`_span_due`). Why: at SLICE_DUE 0.5 a float32 step of 2 decodes and the smallest prompt chunk (43-49 ms of its own)
# got ~3.8 ms per int4 gap and spanned ~170 ms, 1.48-2.48x float32's p99 alone (2026-11-24 13:41-13:57 UTC, docs/
# multi-model.md); the same SLICE_DUE raised for every step (0.6, 0.7) also lengthened the decode-only steps' int4
# gaps and grew float32's shared target, and was no fix. The default since 2026-11-24 16:00 UTC, with SLICE_TAIL and
# SLICE_STREAM_DUE (docs/multi-model.md). PACELINE_SLICE_SPAN=0: SLICE_DUE alone (the A/B). SLICE_DUE_MAX 0.9: in the
# step log of 15:43 UTC, at 0.8, float32's steps of 2 decodes and a 16-token chunk (50-56 ms of their own) were held
# to ~7.3 ms per int4 round and its gaps were ~138 ms, at its 1.2x-alone bound; int4's gaps in those rounds ~18.5 ms
SLICE_SPAN = os.environ.get("PACELINE_SLICE_SPAN", "1") != "0"
# The span rule's "gap alone" is the model's calm step target (core/scheduler.py step_target_ms) while at most one of
# its prompts is queued, as its scheduler then holds its steps to that when it runs alone: since the calm target
# (2026-11-24 19:30 UTC) float32's p99 gap alone fell from ~120 to ~70 ms, while the span rule still let its steps
# span the whole 120 ms target beside int4 (run W, docs/multi-model.md). PACELINE_SLICE_CALM=0: the whole target (A/B)
SLICE_CALM = os.environ.get("PACELINE_SLICE_CALM", "1") != "0"
SLICE_DUE_MAX = float(os.environ.get("PACELINE_SLICE_DUE_MAX", "0.9"))
# Every model's KV prefault paced by the whole loop (_pace_prefaults); PACELINE_LOOP_PREFAULT=0: each Engine paces its
# own by its own requests only, as before 2026-11-24 16:00 UTC (the A/B)
LOOP_PREFAULT = os.environ.get("PACELINE_LOOP_PREFAULT", "1") != "0"
# While another model streams, a step of this model whose own decodes already fill its (shared) step-time target
# gives a prompt younger than SLICE_DEFER_S no chunk, instead of the one block every prompt otherwise gets
# (SchedulerConfig.defer_prompt_s). Why: float32 with two streams and a prompt beside int4 streams ran steps of two
# decodes and a 16-token chunk predicted at 58.6 ms against a 37-40 ms share, each spanning 141-158 ms of wall time
# with the int4 steps inside it (run CC, 2026-11-29, docs/multi-model.md). The bound keeps a prompt from waiting
# longer than that for a stream that never ends; 3 s, since at 1 s the prompt of run CC's stretch (it arrived ~0.8 s
# before int4's stream) got its block back after a few steps (run DD). PACELINE_SLICE_DEFER_S=0: every prompt its
# block, as before (A/B)
SLICE_DEFER_S = float(os.environ.get("PACELINE_SLICE_DEFER_S", "3.0"))
# A step that nothing could preempt runs in one piece even while the loop slices (`_start`); 0: every step of a
# slicing loop is sliced, as before 2026-11-29 (the A/B)
SLICE_WHOLE = os.environ.get("PACELINE_SLICE_WHOLE", "1") != "0"
# The only busy model's step of prompts alone (no stream of its own) runs sliced too, and between two of its layers a
# load's turn, or the first prompt of a model just loaded, comes in (`_advance`; `_Run.lone`). Why: such a step runs
# the whole lone-prefill budget, an int4 prompt of 979 tokens 525 ms, and a load that asked during it waited for all
# of it: first tokens of 0.50-0.62 s after the request where it ran (switch runs LLLL, MMMM, 2026-11-29).
# PACELINE_LONE_SLICED=0: whole, as before (the A/B)
LONE_SLICED = os.environ.get("PACELINE_LONE_SLICED", "1") != "0"
LOAD_TURN = "(load)"  # what `_advance` returns when a lone step makes way for a load's turn
# Only a model with shorter steps than the running one may preempt it (`_preemptors`); 0: any streaming model, as
# before 2026-11-29 (the A/B)
SLICE_SHORTER = os.environ.get("PACELINE_SLICE_SHORTER", "1") != "0"
# Lanes: while exactly two models are busy (no load, no debut), each one's steps run back to back on a worker thread
# of its own with half the OpenMP threads each, both at once, instead of taking turns on all of them (`_lane_step`).
# Why: a step on both threads is not twice as fast as on one at these sizes (float32 two decodes 27.6 against 47.0
# ms, int4 one decode 11.6 against 17.1 ms, /tmp script 2026-11-29 12:35 UTC), so side by side each model's streams
# wait for their own step only: float32's 44-48 ms against the 77-100 ms its sliced steps spanned beside int4
# streams (run BBB's step log), int4's 19 ms against ~20 ms. On by default since 2026-11-29 13:45 UTC (runs DDD-HHH
# of benchmarks/summaries/multi_model.md: both models' p99 TBT within 1.2x alone in 6 of 14 lane arms, float32 within
# in 12; the rotation 2 of 15 arms that day); PACELINE_LANES=0: the rotation alone (the A/B)
LANES = os.environ.get("PACELINE_LANES", "1") != "0"
# A lane's step on one thread against the prediction for both (the step-time model is profiled on all threads):
# its targets are divided by this, learned per model from its lane steps with a prompt chunk (`_lane_ratio`). The
# guess: float32 steps of two decodes and a 19-30-token chunk took 98-118 ms in a lane against 66-72 ms predicted
# (2026-11-29 13:20 UTC step log)
LANE_RATIO_GUESS = 1.6
# PACELINE_LANE_RESTART=1: a lane's next step is scheduled and its forward sent as soon as its step has been updated,
# before the outputs go out (_lane_step), not on the engine loop's next call. Off: it cut the loop's turn-around
# (int4 1.57 -> 0.94 ms at the median) but no p99 or p50 TBT moved for it over 5 arms against 2 (runs LLL and NNN,
# 2026-11-29; float32's p50 32.68-34.21 ms without, 33.66-36.93 with: the engine thread's work then runs beside
# both lanes' forwards on the two cores), and a request added meanwhile waited one step more
LANE_RESTART = os.environ.get("PACELINE_LANE_RESTART", "0") == "1"
# The lane of the model with the longer decode steps (`_longer_decodes`) runs at this nice value, so that the engine,
# HTTP and client threads that share the two cores take their time from it rather than from the short steps, whose
# streams' bound is the tighter one (int4 lane steps went from 15-18 to 30-38 ms for 0.6 s beside unchanged float32
# ones, 13:33 UTC step log). Raising a lane's priority back needs CAP_SYS_NICE: without it, a worker once lowered
# stays there.
# PACELINE_LANE_NICE=0: equal priorities (the A/B)
LANE_NICE = int(os.environ.get("PACELINE_LANE_NICE", "5"))
# The interpreter's switch interval (sys.setswitchinterval) in a server of several models (set by
# entrypoints/multi_serving.py): a thread waiting for the GIL gets it from one running Python after at most this
# long. The engine thread, two lane workers and the HTTP loop take turns in it; at Python's 5 ms a lane's next step
# could wait that long for the engine thread to schedule it. At 0.5 ms, 10 pairs of one-loop arms in 4 runs
# (XXXX-AAAAA, 2026-11-29 22:14-22:46 UTC): int4's p99 TBT lower in 7 of 10 (mean 18.08 against 19.04 ms), float32's
# mean 78.74 against 78.08, tok/s unchanged, both within 1.2x alone in 4 of 10 either way: a small effect, inside
# these runs' noise; int4's step-to-step turn-around p90 2.38 / 2.29 ms against 3.14 / 2.84 in two step logs.
# PACELINE_SWITCH_INTERVAL_MS=0: Python's own (the A/B)
GIL_SWITCH_S = float(os.environ.get("PACELINE_SWITCH_INTERVAL_MS", "0.5")) / 1000.0
LOAD_TURN_MAX_S = 2.0  # without a step-time target, a turn holds the loop at most this long
# While a model loads, the other models' step-time targets leave room for a turn of it beside their streams' gap
# (_share_step_target); PACELINE_LOAD_TURN_TARGET=0: one share per busy model and the load, as before (the A/B)
LOAD_TURN_TARGET = os.environ.get("PACELINE_LOAD_TURN_TARGET", "1") != "0"
# A load's pieces (loader.piece_break) chain into one turn until it has lasted this long: in parts of 1-30 ms, one
# turn each, a float32 load took ten rotations, and beside int4 steps of 50 ms (its own prompt chunks) its first
# token came 0.706 s after the request (2026-11-29 12:41 UTC switch run). With nothing busy, a turn takes every piece
CHAIN_WAIT_S = 0.002  # how long a turn waits for the next piece to ask (the loader asks right after one ends)
LOAD_TURN_CHAIN_S = float(os.environ.get("PACELINE_LOAD_TURN_CHAIN_MS", "20")) / 1000.0
# ... and no longer than the busy models' shortest last decode step (`_turn_chain_s`): their streams then wait at most
# about two decode steps while a model loads, within the p99 their own prompt chunks set, where 20 ms turns beside
# int4 decode steps of 6-10 ms made gaps past it (float32 loads: others within their p99 in 11 of 28, 2026-11-29).
# The pieces break finely enough for that since loader.PIECE_TICK_S. PACELINE_LOAD_TURN_BY_DECODE=0: the fixed chain
LOAD_TURN_BY_DECODE = os.environ.get("PACELINE_LOAD_TURN_BY_DECODE", "1") != "0"
TURN_GUESS_S = 0.04  # a turn's length before the first one is measured (the bundled model's: 23-42 ms, 2026-11-29)
STEP_RING = 512  # the last steps of every model, kept so that a switch can show the steps around it
SWITCH_STEPS_BEFORE_S = 0.5  # a switch's step record starts this long before its request


@dataclass
class MultiStats:
    """The sums AsyncEngine reads (num_waiting against max_waiting_requests)."""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0


@dataclass
class LoadTimeline:
    """When each part of a load on demand happened (time.monotonic), from the request that asked for the model to
    that request's first token: the split a switch's first-token time is judged by. The residency marks the load
    (size estimate, room made, Engine built, pages mapped, joined); MultiEngine marks the rest on the engine
    thread (request added, first step start and end, first token) and then calls on_first_token (the residency
    starts the work it held back: packing, the KV pool's prefault)."""
    start: float
    marks: dict[str, float] = field(default_factory=dict)
    on_first_token: Callable[[], None] | None = None
    # every model's steps from SWITCH_STEPS_BEFORE_S before the request to the first token: (model, start, end,
    # engine thread's CPU seconds, decode tokens, prompt tokens), times in seconds after the request
    steps: list[tuple] = field(default_factory=list)

    def mark(self, what: str, when: float | None = None) -> None:
        self.marks.setdefault(what, time.monotonic() if when is None else when)  # the first time counts

    def split(self) -> dict[str, float]:
        """Seconds from the request to each mark, in the order they happened."""
        return {k: round(v - self.start, 4) for k, v in sorted(self.marks.items(), key=lambda kv: kv[1])}

    def finish(self) -> None:
        callback, self.on_first_token = self.on_first_token, None
        if callback is not None:
            callback()


class LoadTurns:
    """Turns between two steps that a load's pieces take on the loader thread while the engine thread waits.

    Why: a piece of a load (unpickling a runtime snapshot into an Engine, faulting its pages in) beside the other
    models' steps holds the interpreter, which the engine thread needs between every two torch ops, and takes a
    core from their two-thread steps: on 2026-11-24 the step it overlapped grew by 25-85 ms and more. Taken as a
    turn, the piece costs the other streams one bounded wait, like one step of another model, and runs at full
    speed. The loader asks (take), the engine thread grants it between two steps (serve) and waits until the piece
    ends or its limit passes; after the limit the piece goes on beside the steps, as without turns."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state = "idle"  # idle | asked | granted
        self._ended = False  # the granted piece has ended (a flag of its own: the loader may ask for its next
        # turn before the engine thread wakes, and that must not read as "still running")
        self.pending = False  # a load is under way: it counts as one more busy model in the step-time shares

    @contextmanager
    def take(self, nudge: Callable[[], None] | None = None,
             timeout_s: float = 5.0) -> Iterator[Callable[[], None]]:
        """On the loader thread: `with turns.take(nudge) as next_turn: piece()`. nudge() has the engine thread call
        serve even while it is idle (AsyncEngine.call); a busy one serves at the top of its next step anyway. The
        wait for a grant is bounded: an engine thread that never comes round must not block a load. The piece may
        call next_turn() between two of its parts: its turn ends there and the next part waits for a turn of its
        own, the busy models' steps in between (a turn's length is what their streams wait)."""
        def next_turn() -> None:
            self._end()
            self._begin(nudge, timeout_s)

        self._begin(nudge, timeout_s)
        try:
            yield next_turn
        finally:
            self._end()

    def serve(self, limit_s: float, chain_s: float = 0.0) -> float:
        """On the engine thread between two steps: if a piece asks for a turn, let it run and wait until it ends
        or limit_s passes; while less than chain_s has passed, a next piece that asks at once (next_turn) runs in
        the same turn. Seconds waited (0: no piece asked)."""
        with self._cond:
            if self._state != "asked":
                return 0.0
            start = time.monotonic()
            while True:
                self._state, self._ended = "granted", False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._ended, timeout=max(0.0, limit_s - (time.monotonic() - start)))
                if not self._ended or time.monotonic() - start >= chain_s:
                    break
                if not self._cond.wait_for(lambda: self._state == "asked", timeout=CHAIN_WAIT_S):
                    break
            return time.monotonic() - start

    def is_asked(self) -> bool:
        return self._state == "asked"

    def _begin(self, nudge: Callable[[], None] | None, timeout_s: float) -> None:
        with self._cond:
            self._state = "asked"
            self._cond.notify_all()  # an engine thread chaining pieces in one turn waits for this (serve)
        if nudge is not None:
            nudge()
        with self._cond:
            self._cond.wait_for(lambda: self._state == "granted", timeout=timeout_s)
            self._state = "idle"  # the piece runs now (granted, or the wait gave up): nothing more to ask

    def _end(self) -> None:
        with self._cond:
            self._state, self._ended = "idle", True
            self._cond.notify_all()


class MultiEngine:
    def __init__(self, config: EngineConfig, engines: dict[str, Engine] | None = None) -> None:
        self.config = config  # the server's settings; AsyncEngine reads config.scheduler.max_waiting_requests
        self.engines: dict[str, Engine] = {}
        self._step_ms: dict[str, float] = {}  # each model's own max_step_ms, before the division by busy models
        self._budget: dict[str, int] = {}  # each model's own token budget, before a cap for the other's streams
        self._owner: dict[str, str] = {}  # request id -> model
        self._since: dict[str, float] = {}  # model -> when its streams started waiting for the loop
        self._debut: dict[str, LoadTimeline] = {}  # models loaded on demand that have not yet produced a token
        self.risk_s = config.tbt_goal_ms / 2000.0 if config.tbt_goal_ms > 0 else 0.1
        self.last_model: str | None = None
        self.last_step = None
        # (model, start, end, engine thread CPU s, decode tokens, prompt tokens) per step: one tuple per step is
        # the whole cost; a switch copies the stretch around it into its LoadTimeline (what stalls the others)
        self.recent_steps: deque[tuple] = deque(maxlen=STEP_RING)
        self.turns = LoadTurns()
        self._turn_since_step = False  # a load's turn was served since the last step
        self._turn_s = TURN_GUESS_S  # the last load turn's length (_share_step_target)
        self._inflight: dict[str, _Run] = {}  # model -> its suspended step (at most one each)
        self._lone: dict[str, int] = {}  # model -> its own lone_prefill_tokens (0 while another model is busy)
        self._layers: dict[str, int] = {}  # model -> layer boundaries in one of its sliced steps (learned)
        self._tail_s: dict[str, float] = {}  # model -> its last sliced step's tail: last boundary to the end
        self._decode_s: dict[str, float] = {}  # model -> its last step of decodes alone (no prompt chunk)
        self._loop_s = 0.001  # the loop's own time between one model's step and the next (SLICE_SPAN; averaged)
        self._deferred_aborts: dict[str, list[str]] = {}  # aborts that wait for the model's suspended step
        self._lanes: dict[str, _Run] = {}  # model -> its step whose forward runs on a lane worker now
        self._lane_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}  # model -> its lane's worker
        self._threads = step_threads()  # the engine thread's OpenMP threads, restored after lanes
        self._lane_ratio: dict[str, float] = {}  # model -> its lane steps' time over their prediction (learned)
        self._calm: dict[str, tuple[float, float]] = {}  # model -> its own calm and short step targets
        for name, engine in (engines or {}).items():
            self.add_model(name, engine)

    # ---- models in and out (engine thread) ----------------------------------------------------------------------

    def add_model(self, name: str, engine: Engine, timeline: LoadTimeline | None = None) -> None:
        if name in self.engines:
            raise ValueError(f"model {name!r} is already loaded")
        self.engines[name] = engine
        if timeline is not None:
            timeline.mark("joined")
            self._debut[name] = timeline
        self._step_ms[name] = engine.scheduler.config.max_step_ms
        self._calm[name] = (engine.scheduler.config.calm_step_ms, engine.scheduler.config.short_step_ms)
        self._budget[name] = engine.scheduler.config.max_num_batched_tokens
        self._lone[name] = engine.scheduler.config.lone_prefill_tokens

    def remove_model(self, name: str) -> Engine:
        """Take an idle model out of the loop; the caller drops the Engine to free its memory."""
        engine = self.engines.get(name)
        if engine is None:
            raise ValueError(f"model {name!r} is not loaded")
        if engine.has_unfinished():
            raise ValueError(f"model {name!r} still has requests in flight")
        del self.engines[name]
        debut = self._debut.pop(name, None)
        if debut is not None:  # it never produced a token: what waited for that goes on now
            debut.finish()
        self._step_ms.pop(name, None)
        self._calm.pop(name, None)
        self._lane_ratio.pop(name, None)
        pool = self._lane_pools.pop(name, None)
        if pool is not None:
            pool.shutdown(wait=False)
        self._budget.pop(name, None)
        self._lone.pop(name, None)
        self._since.pop(name, None)
        for learned in (self._layers, self._tail_s, self._decode_s):
            learned.pop(name, None)
        return engine

    def is_idle(self, name: str) -> bool:
        engine = self.engines.get(name)
        return engine is None or not engine.has_unfinished()

    # ---- the Engine interface AsyncEngine drives ----------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, model: str | None = None, client_id: str = "") -> Any:
        if model is None:
            if len(self.engines) != 1:
                raise ValueError("name the model: this server serves several")
            model = next(iter(self.engines))
        engine = self.engines.get(model)
        if engine is None:
            raise ValueError(f"model {model!r} is not loaded")
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        was_idle = not engine.has_unfinished()
        request = engine.add_request(request_id, prompt, params, priority=priority, arrival_time=arrival_time,
                                     client_id=client_id)
        self._owner[request_id] = model
        if model in self._debut:
            self._debut[model].mark("request_added")
        if was_idle:  # its streams' clock starts at this arrival, not at the model's last step long ago
            self._since[model] = request.arrival_time
            self._pace_prefaults()
        return request

    def abort(self, request_id: str) -> None:
        model = self._owner.get(request_id)
        if model in self._inflight or model in self._lanes:
            # its model's step is suspended mid-forward with this request in its batch: freed now, its blocks would
            # go back to the pool while that forward still writes them, and update() would meet a request that is
            # gone; the abort waits for the step's end (_finish)
            self._deferred_aborts.setdefault(model, []).append(request_id)
        elif model is not None and model in self.engines:
            self.engines[model].abort(request_id)

    def has_unfinished(self) -> bool:
        """Work for the engine loop: a model's requests, or a load piece asking for a turn. Why the ask: a load's
        nudge that reached the loop while a busy model had just had its turn (serve_load_turn skips it: one turn per
        rotation) was lost when that model's last request then finished; the idle loop served no turn and the load
        waited out its 5 s timeout (a float32 first token 5.22 s after its request, switch run WWW, 2026-11-29)."""
        return any(e.has_unfinished() for e in self.engines.values()) or self.turns.is_asked()

    def stats(self) -> MultiStats:
        total = MultiStats()
        for e in self.engines.values():
            s = e.stats()
            total.num_running += s.num_running
            total.num_waiting += s.num_waiting
            total.num_swapped += s.num_swapped
        return total

    def serve_load_turn(self) -> None:
        """Between two steps (AsyncEngine's command, or the top of step()): a load piece that asked for a turn
        runs now, bounded by what the step-time target leaves beside the busy models' next steps."""
        if not self.turns.is_asked():
            return
        busy = [name for name, e in self.engines.items() if e.has_unfinished()]
        if busy and self._turn_since_step:  # one turn per rotation: the busy models step between two turns
            return
        self._turn_since_step = True
        limit_s = (self._foreign_step_s(None, busy) if busy else 0.0) or LOAD_TURN_MAX_S
        self._serve_turn(limit_s, self._turn_chain_s(busy) if busy else limit_s)

    def _serve_turn(self, limit_s: float, chain_s: float) -> None:
        """Serve a load piece's turn now (LoadTurns.serve) and record it among the steps."""
        start, cpu = time.monotonic(), time.thread_time()
        if self.turns.serve(limit_s, chain_s) > 0:
            end = time.monotonic()
            self._turn_s = end - start
            self.recent_steps.append((LOAD_TURN, start, end, time.thread_time() - cpu, 0, 0))

    def _turn_chain_s(self, busy: list[str]) -> float:
        """How long a load's turn chains its pieces beside the busy models: LOAD_TURN_CHAIN_S, or less, their
        shortest last decode-only step (LOAD_TURN_BY_DECODE; a model with none yet does not count)."""
        decodes = [self._decode_s[m] for m in busy if m in self._decode_s]
        if not LOAD_TURN_BY_DECODE or not decodes:
            return LOAD_TURN_CHAIN_S
        return min(LOAD_TURN_CHAIN_S, min(decodes))

    def step(self) -> list[RequestOutput]:
        """Run steps until one model's step ends; its outputs. Where slicing applies, a step is suspended between
        two layers when another model's streams come due (`_advance`), that model's step runs (and its outputs
        return at once), and the suspended one resumes on a later call."""
        self.serve_load_turn()
        busy = [name for name, e in self.engines.items() if e.has_unfinished()]
        if not busy:
            self.last_model, self.last_step = None, None
            self._pace_prefaults()
            return []
        if self._lanes or self._lane_mode(busy):
            return self._lane_step(busy)
        name = busy[0] if len(busy) == 1 else self.pick(busy, time.monotonic())
        sliced = SLICE and len(busy) > 1 and all(sliceable(self.engines[m]) for m in busy)
        while True:
            run = self._inflight.pop(name, None) or self._start(name, busy, sliced)
            preemptor = self._advance(name, run, busy)
            if preemptor is None:
                return self._finish(name, run)
            self._inflight[name] = run  # resumed by a later call, once the preemptor's step has ended
            if preemptor == LOAD_TURN:  # a lone step of prompts: no stream waits, the load takes what it asks
                self._serve_turn(LOAD_TURN_MAX_S, LOAD_TURN_MAX_S)
                return []
            name = preemptor

    # ---- lanes: two models' steps side by side (LANES) ---------------------------------------------------------

    def _lane_mode(self, busy: list[str]) -> bool:
        """Whether the busy models run in lanes: exactly two, both sliceable (a plain Engine on the single-process
        runner) on the CPU (lanes split its cores), no load under way or debut (their turns and first prompts follow
        the rotation's rules), and no step of the rotation still suspended."""
        return (LANES and len(busy) == 2 and not self.turns.pending and not self._debut and not self._inflight
                and all(sliceable(self.engines[m]) and self.engines[m].runner.device.type == "cpu" for m in busy))

    def _lane_step(self, busy: list[str]) -> list[RequestOutput]:
        """In lane mode, start a step for each busy model that has none under way (scheduled here, its forward on its
        worker thread with half the OpenMP threads), then wait for a forward to end and finish the step of every
        forward that has ended, the earliest first (with LANE_RESTART each model's next step started before any
        of their outputs go out). Out of lane mode, the steps still under way end first, then the engine thread's
        threads come back."""
        if self._lane_mode(busy):
            for name in busy:
                if name not in self._lanes:
                    run = self._start_lane(name)
                    if run is not None:  # nothing to run (an empty schedule): its outputs (aborts) go out now
                        return self._finish(name, run)
        if not self._lanes:
            return []
        futures = {run.future: name for name, run in self._lanes.items()}
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        outputs: list[RequestOutput] = []
        for name in sorted((futures[f] for f in done), key=lambda n: _forward_end(self._lanes[n].future)):
            run = self._lanes.pop(name)
            try:
                next(run.gen)
            except StopIteration as finished:
                run.outputs = finished.value
            last = self.engines[name].last_step
            if last is not None and last.num_prefill_tokens > 0 and last.predicted_s > 0:
                # as the engine's scale learns from chunk steps only: decode steps are predicted differently well
                ratio = self._lane_ratio.get(name, LANE_RATIO_GUESS)
                self._lane_ratio[name] = ratio + 0.2 * (last.duration / last.predicted_s - ratio)
            outputs += self._finish(name, run)
            busy = [m for m, e in self.engines.items() if e.has_unfinished()]
            if LANE_RESTART and name in busy and self._lane_mode(busy):
                # its next forward starts now, not after the AsyncEngine has sent these outputs and come back
                started = self._start_lane(name)
                if started is not None:
                    outputs += self._finish(name, started)
        if not self._lanes and not self._lane_mode(busy):
            set_step_threads(self._threads)  # the rotation runs on the engine thread again
        return outputs

    def _start_lane(self, name: str) -> "_Run | None":
        """Schedule `name`'s step and send its forward to a lane worker; the _Run when it ended at once (an empty
        schedule), else None (it is under way in self._lanes). Its streams wait for its own step only, so it gets
        its own step-time targets and token budget, divided by what one thread costs its steps (`_lane_ratio`)."""
        engine = self.engines[name]
        config = engine.scheduler.config
        config.lone_prefill_tokens = 0
        config.hold_prompts = False  # lanes run only while no model loads or debuts
        # a young prompt waits for room as in the rotation (SLICE_DEFER_S): on one thread a float32 step of two
        # decodes and the 16-token floor took 78-122 ms against its 46-53 ms target (13:26 UTC step log)
        config.defer_prompt_s = SLICE_DEFER_S
        ratio = self._lane_ratio.get(name, LANE_RATIO_GUESS)
        calm, short = self._calm[name]
        config.max_step_ms, config.calm_step_ms, config.short_step_ms = (
            self._step_ms[name] / ratio, calm / ratio, short / ratio)
        engine.learn_steps = False
        if not config.auto_max_num_batched_tokens:
            config.max_num_batched_tokens = self._budget[name]
        pool = self._lane_pools.get(name)
        if pool is None:
            pool = self._lane_pools[name] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"paceline-lane-{name}")
        nice = LANE_NICE if self._longer_decodes(name) else 0
        run = _Run(None, False, time.monotonic(), steps_before=engine.scheduler.num_steps)
        runner = engine.runner

        def execute(out: Any) -> Generator[None, None, Any]:
            run.future = pool.submit(_lane_forward, runner, out, max(1, self._threads // 2), nice)
            yield
            result, run.cpu, _ = run.future.result()
            return result

        run.gen = engine.step_iter(execute=execute)
        try:
            next(run.gen)
        except StopIteration as finished:
            run.outputs = finished.value
            return run
        self._lanes[name] = run
        return None

    def _longer_decodes(self, name: str) -> bool:
        """Whether `name`'s last decode-only step outlasted every other busy model's (each must have had one): its lane
        is the one lowered (LANE_NICE). From decode steps, not the last step of any kind: a lane's worker once
        lowered stays lowered, and by its 619 ms prompt step int4 outlasted float32's decodes and kept nice 5 for
        the rest of the run; its next decode step then took 44.5 ms of wall time for 15.9 ms of CPU (a debug log of
        2026-11-29 15:44 UTC)."""
        own = self._decode_s.get(name)
        others = [self._decode_s.get(m) for m, e in self.engines.items() if m != name and e.has_unfinished()]
        return own is not None and bool(others) and all(o is not None and own > o for o in others)

    def _start(self, name: str, busy: list[str], sliced: bool) -> "_Run":
        engine = self.engines[name]
        config = engine.scheduler.config
        engine.learn_steps = True
        config.calm_step_ms, config.short_step_ms = self._calm[name]  # lanes divide them
        # a step of prompts alone may use the lone-prefill budget only while no other model is busy: beside them
        # the budgets below bound it
        config.lone_prefill_tokens = self._lone[name] if len(busy) == 1 else 0
        # A model loading on demand, or waiting for its first token, will stream next: its turns and its first
        # prompt run between this model's steps, so those steps defer young prompts too. Why: float32 steps of a
        # decode and the 16-token floor (54-79 ms) with a 25-42 ms load turn between two of them made its streams'
        # gaps 106-113 ms against their p99 of 98 ms while int4 loaded (2026-11-29 10:00 UTC switch run)
        coming = self._another_coming(name)
        others_stream = any(has_streams(self.engines[o]) for o in busy if o != name)
        config.defer_prompt_s = SLICE_DEFER_S if others_stream or coming else 0.0
        config.hold_prompts = self._holds_prompts(name)
        if sliced:
            # Another model's streams wait for a slice of this step, not all of it (`_advance`): a step of prompts
            # alone is cut to the whole target only and a debut's prompt runs whole. The target stays shared: this
            # model's own streams still wait for its own step plus the other models' steps run inside it.
            self._share_step_target(busy, sliced=SLICE_SHARE)
            if not config.auto_max_num_batched_tokens:  # an auto budget the scheduler sizes from the target itself
                config.max_num_batched_tokens = self._sliced_budget(name, busy)
        else:
            self._share_budgets(name, busy)
        debut = self._debut.get(name)
        if debut is not None:
            debut.mark("first_step_start")
        # Run in one piece (the whole C++ layer loop in one call) where nothing could preempt it: no other model
        # streams, or the only ones that do have their own step suspended (a preemptor's step, which `_advance`
        # never suspends). A layer-sliced step costs one call and one yield a layer: an int4 decode step took 11.2
        # against 9.8 ms whole (a /tmp script, 2026-11-29), paid by every int4 step run inside a float32 one
        # (PACELINE_SLICE_WHOLE=0: sliced, as before; the A/B)
        if sliced and SLICE_WHOLE and not self._preemptors(name, busy):
            sliced_run = False
        else:
            sliced_run = sliced
        lone = (LONE_SLICED and not sliced and len(busy) == 1 and not has_streams(engine) and sliceable(engine))
        return _Run(engine.step_iter(sliced=sliced_run or lone), sliced_run or lone, time.monotonic(),
                    steps_before=engine.scheduler.num_steps, lone=lone)

    def _sliced_budget(self, name: str, busy: list[str]) -> int:
        """Sliced, the token budget of `name`'s step: its own, but while another model streams a step of prompts
        alone is cut to what its own whole step-time target predicts (SLICE_PROMPT_CAP). Why: another model's
        stream waits for one layer of this step past its due time when a layer is longer than the time it may
        wait; a 216-token float32 prompt whole had ~9.5 ms layers, and an int4 stream due every ~6 ms got
        ~22 ms gaps (2026-11-24 08:35 UTC step log). Steps with decodes of their own are cut by the shared
        target already (the scheduler cuts chunks around them). A debut's first prompt stays whole (DEBUT_DUE)."""
        own = self._budget[name]
        sched = self.engines[name].scheduler
        if (not SLICE_PROMPT_CAP or name in self._debut or self._step_ms[name] <= 0 or sched.step_time is None
                or not any(has_streams(self.engines[o]) for o in busy if o != name)):
            return own
        fit = prompt_tokens_within(sched.step_time, self._step_ms[name] / 1000.0 / sched.step_time_scale, own,
                                   sched.block_size)
        return min(own, max(fit, len(sched.running) + sched.block_size))

    def _share_budgets(self, name: str, busy: list[str]) -> None:
        """Without slicing, another model's streams wait for the whole of this step: the step-time target is
        shared among the busy models and a step of prompts is capped to its share (module docstring)."""
        engine = self.engines[name]
        if len(busy) > 1 or self.turns.pending or engine.scheduler.config.max_step_ms != self._step_ms[name]:
            self._share_step_target(busy)
        debut = self._debut.get(name)
        if debut is not None and DEBUT_STEP == "whole":
            engine.scheduler.config.max_num_batched_tokens = self._budget[name]
            return
        if debut is not None and DEBUT_STEP == "fit" and self._step_ms[name] > 0:
            # one step of its own: the target less the other busy models' next steps, never below the share
            config = engine.scheduler.config
            config.max_step_ms = max(config.max_step_ms, 1e3 * self._foreign_step_s(name, busy))
        self._cap_budget(name, busy)

    def _advance(self, name: str, run: "_Run", busy: list[str]) -> str | None:
        """Run `name`'s step on from where it stood; None once it has ended (run.outputs), else the model whose
        streams came due at a layer boundary (the step stays suspended): another streaming model whose streams
        have waited SLICE_DUE x its own last step since that step ended.
        A model whose own step is suspended is not due (it resumes once the preemptor's step ends): no ping-pong,
        and the running step always makes at least one layer of progress per call."""
        cpu = time.thread_time()
        resumed = time.monotonic()
        if run.boundaries and self.last_model not in (None, name) and self.last_model in self._since:
            # resumed after another model's step: the loop's own time between two steps (emitting its tokens,
            # the pick), which no model's layers use; an average, and a long idle wait is no sample
            between = resumed - self._since[self.last_model]
            if between < 0.02:
                self._loop_s += 0.2 * (between - self._loop_s)
        watch = self._preemptors(name, busy, run.predicted_s) if run.sliced else []
        debut = name in self._debut and DEBUT_BY_S > 0
        if watch and (run.predicted_s is not None or debut):
            watch = self._later_due(name, run, watch, resumed, run.own_s)
        first, shorter, tail_first = self._watch_times(name, watch)
        layers = self._layers.get(name, 0) if SLICE_TAIL else 0
        tail = self._tail_s.get(name, 0.0)
        last = resumed
        try:
            while True:
                next(run.gen)
                now = time.monotonic()
                run.boundaries += 1
                if run.lone:  # LONE_SLICED: a load's turn, or a newcomer's first prompt, comes in here
                    newcomer = LOAD_TURN if self.turns.is_asked() else self._newcomer(name)
                    if newcomer is not None:
                        run.cpu += time.thread_time() - cpu
                        run.own_s += now - resumed
                        return newcomer
                judge = debut  # a debut's rest is judged again at every boundary, by the layers run so far
                if watch and run.predicted_s is None and run.boundaries == 1:
                    # scheduled now: the step's predicted own time is known, so the span rule can judge it, and
                    # (SLICE_SHORTER) only the models with shorter steps than it may preempt it
                    run.predicted_s = self._predicted_s(name, run)
                    if run.predicted_s is not None:
                        if SLICE_SHORTER and name not in self._debut:
                            watch = [(t, o) for t, o in watch if self._stream_step_s(o) < run.predicted_s]
                        judge = True
                if judge:  # the due times again, also when SLICE_SHORTER just left no model to watch
                    if watch:
                        watch = self._later_due(name, run, watch, now, run.own_s + now - resumed)
                    first, shorter, tail_first = self._watch_times(name, watch)
                # SLICE_AHEAD: suspend at the last boundary before the due time, not the first one after it (the
                # layer just run stands for the next; after the last layer, the model's last tail: SLICE_TAIL)
                ahead = now - last if SLICE_AHEAD else 0.0
                last = now
                if run.boundaries == layers and tail_first <= now + tail:
                    run.cpu += time.thread_time() - cpu
                    run.own_s += now - resumed
                    return min((start_by, other) for start_by, other in shorter if start_by <= now + tail)[1]
                if first <= now + ahead:  # the whole cost of a boundary where nothing is due: a clock read, compares
                    due = [(start_by, other) for start_by, other in watch if start_by <= now + ahead]
                    run.cpu += time.thread_time() - cpu
                    run.own_s += now - resumed
                    return min(due)[1]
        except StopIteration as done:
            run.outputs = done.value
            if run.boundaries:  # sliced: what the next step's last boundary is judged by
                self._layers[name], self._tail_s[name] = run.boundaries, time.monotonic() - last
            run.cpu += time.thread_time() - cpu
            return None

    def _newcomer(self, name: str) -> str | None:
        """A model loaded on demand, other than `name`, whose first prompt waits and whose step is not suspended."""
        return next((m for m in self._debut if m != name and m in self.engines and m not in self._inflight
                     and self.engines[m].has_unfinished()), None)

    def _watch_times(self, name: str, watch: list[tuple[float, str]]) -> tuple[float, list[tuple[float, str]], float]:
        """For _advance: the first due time; and (SLICE_TAIL) the models with shorter steps than `name`'s, for
        which its tail is waited out, and the first of their due times."""
        first = min((start_by for start_by, _ in watch), default=math.inf)
        if not (SLICE_TAIL and self._layers.get(name, 0)):
            return first, [], math.inf
        # the tail is waited out only for models with shorter steps than this one: an int4 step suspended before its
        # ~3 ms tail let a whole 28 ms float32 step run first, and its stream's gap was 56 ms (2026-11-24 13:34 UTC
        # step log)
        own = self._stream_step_s(name)
        shorter = [(start_by, other) for start_by, other in watch if self._stream_step_s(other) < own]
        return first, shorter, min((start_by for start_by, _ in shorter), default=math.inf)

    def _predicted_s(self, name: str, run: "_Run") -> float | None:
        """The own time of `name`'s step under way as its step-time model predicts it (scaled as the scheduler
        sized it); None when the step was not sized by one."""
        sched = self.engines[name].scheduler
        if run.steps_before in (None, sched.num_steps) or sched.step_time is None or sched.last_shape is None:
            return None
        return sched.step_time(sched.last_shape) * sched.last_scale

    def _later_due(self, name: str, run: "_Run", watch: list[tuple[float, str]], now: float,
                   own_s: float) -> list[tuple[float, str]]:
        """The other models' due times once `name`'s step is scheduled: a debut's by its first-token budget
        (DEBUT_BY_S), any other step's by the span rule (SLICE_SPAN)."""
        if name in self._debut:
            return self._debut_due(name, run, watch, now, own_s) if DEBUT_BY_S > 0 else watch
        return self._span_due(name, run, watch, now, own_s) if SLICE_SPAN else watch

    def _debut_due(self, name: str, run: "_Run", watch: list[tuple[float, str]], now: float,
                   own_s: float) -> list[tuple[float, str]]:
        """DEBUT_BY_S: while a debut's first prompt runs, the other models' streams are due after g of its own work
        per round of their steps, the least g that still ends it DEBUT_BY_S after its request: the rest of its own
        time, `rest`, spans rest x (1 + round / g) <= left, so g >= rest x round / (left - rest), within
        [SLICE_DUE, DEBUT_DUE] x their step. `rest` is the larger of the prediction's remainder and what the layers
        run so far say (a model just loaded may run slower than its step-time model thinks, and it has none until
        its profile is in: _install). Judged again at every boundary while it runs (_advance); with neither, the
        others wait DEBUT_DUE x their step."""
        left = DEBUT_BY_S - (now - self._debut[name].start)
        rest = max(run.predicted_s - own_s, 0.0) if run.predicted_s is not None else None
        layers = self._layer_count(name)
        if run.boundaries and layers:  # boundary k follows layer k; the tail (head, sampling) counted as a layer
            rest = max(rest or 0.0, own_s / run.boundaries * (layers + 1 - run.boundaries))
        if rest is None:
            return watch
        need = self._own_share_needed(watch, rest, left)
        out = []
        for _, other in watch:
            step_s = self._stream_step_s(other)
            g = min(max(need, SLICE_DUE * step_s), DEBUT_DUE * step_s)
            out.append((self._since.get(other, 0.0) + self._loop_s + g, other))
        return out

    def _own_share_needed(self, watch: list[tuple[float, str]], rest: float, left: float) -> float:
        """The least own work g per round of the watched models' steps (each plus the loop's time) for `rest` of
        it to end within `left`: rest x (1 + round / g) <= left (_debut_due, _span_due); inf when it cannot."""
        round_s = sum(self._stream_step_s(other) + self._loop_s for _, other in watch)
        return rest * round_s / (left - rest) if left > rest else math.inf

    def _layer_count(self, name: str) -> int:
        """Layer boundaries in one of `name`'s sliced steps: learned from its last one, else its model's layers."""
        model = getattr(self.engines[name].runner, "model", None)
        return self._layers.get(name) or len(getattr(model, "layers", ()))

    def _span_due(self, name: str, run: "_Run", watch: list[tuple[float, str]], now: float,
                  own_s: float) -> list[tuple[float, str]]:
        """SLICE_SPAN: the other models' due times, later where `name`'s own streams would otherwise wait longer
        than its whole step-time target (about its gap served alone). Each round of the others costs their steps
        plus the loop's time between two steps (`_loop_s`) and gives this step g of its own; the rest of its
        predicted own time, `rest`, must fit in what is left of the target, `left`: rest x (1 + round / g) <= left,
        so g >= rest x round / (left - rest). g stays within [what SLICE_DUE gives, SLICE_DUE_MAX x their step]: a
        short-step model's gap is its step plus g, and its own 1.2x-alone bound is what caps it."""
        target = self._gap_alone_s(name)
        if target <= 0 or name in self._debut or run.predicted_s is None or not has_streams(self.engines[name]):
            return watch
        rest = max(run.predicted_s - own_s, 0.0)
        left = target - (now - self._since.get(name, run.start))
        need = self._own_share_needed(watch, rest, left)
        return [(max(start_by, self._since.get(other, 0.0) + self._loop_s
                     + min(need, SLICE_DUE_MAX * self._stream_step_s(other))), other) for start_by, other in watch]

    def _gap_alone_s(self, name: str) -> float:
        """About `name`'s stream gap served alone (the span rule's bound): its whole step-time target, or its calm
        target while at most one of its prompts is queued (SLICE_CALM)."""
        target = self._step_ms.get(name, 0.0)
        sched = self.engines[name].scheduler
        calm = sched.config.calm_step_ms  # never shared: only max_step_ms is divided among busy models
        if SLICE_CALM and 0 < calm < target and not sched.others_queued():
            target = calm
        return target / 1e3

    def _preemptors(self, name: str, busy: list[str], own_s: float | None = None) -> list[tuple[float, str]]:
        """(when due, model) of every other model that may preempt `name`'s step (see _advance). SLICE_SHORTER:
        only a model whose streams' step is shorter than this step's own time (`own_s`: its prediction once
        scheduled, else `_own_estimate`) may: a longer step run inside a short one makes the short one's streams
        wait for all of it. Before that rule a float32 step of one decode (~18 ms) came due half way through
        int4's decode steps (~9 ms) and ran inside them: those int4 gaps were ~35 ms (/tmp script, 2026-11-29).
        Not for a debut's first prompt: no stream of its own waits on it, and (DEBUT_BY_S) its first token sets
        how long the others wait; an int4 debut's 64-token prompt, predicted shorter than a float32 step, ran
        whole (50-80 ms) while the float32 streams waited (2026-11-29 09:53 UTC switch run)."""
        if own_s is None:
            own_s = self._own_estimate(name)
        watch = []
        for other in busy:
            engine = self.engines[other]
            if other == name or other in self._inflight or not has_streams(engine):
                continue
            step_s = self._stream_step_s(other)
            if SLICE_SHORTER and step_s >= own_s and name not in self._debut:  # a debut has no streams to keep
                continue
            factor = DEBUT_DUE if name in self._debut else SLICE_DUE
            watch.append((self._since.get(other, 0.0) + factor * step_s, other))
        return watch

    def _own_estimate(self, name: str) -> float:
        """`name`'s next step's own time before it is scheduled: its streams' step while it has no prompt to
        prefill (a decode step like the last); unbounded when a prompt may join (a chunk may be long)."""
        sched = self.engines[name].scheduler
        if sched.waiting or any(r.num_output_tokens == 0 for r in sched.running) or not has_streams(self.engines[name]):
            return math.inf
        return self._stream_step_s(name) or math.inf

    def _another_coming(self, name: str) -> bool:
        """Whether another model than `name` is loading on demand or waiting for its first token: it streams next."""
        return self.turns.pending or any(other != name for other in self._debut)

    def _holds_prompts(self, name: str) -> bool:
        """Whether `name`'s steps run its decodes only (HOLD_PROMPTS): it streams while another model is coming."""
        return HOLD_PROMPTS and self._another_coming(name) and has_streams(self.engines[name])

    def _stream_step_s(self, name: str) -> float:
        """The step of `name` that its streams' due time is counted in (_preemptors): its last one; but after a
        step of prompts alone (its streams' first token), or of a chunk beside its decodes while its prompts are
        held (HOLD_PROMPTS), the next is a decode step, so (SLICE_STREAM_DUE) its last step of decodes alone, or the
        step-time model's prediction of one for its streams."""
        engine = self.engines[name]
        last = engine.last_step
        if last is None:
            return 0.0
        held_chunk = last.num_prefill_tokens > 0 and self._holds_prompts(name)
        if not SLICE_STREAM_DUE or (last.num_decode_tokens > 0 and not held_chunk):
            return last.duration
        if name in self._decode_s:
            return self._decode_s[name]
        sched = engine.scheduler
        streams = [r.num_tokens for r in sched.running if r.num_output_tokens > 0]
        if sched.step_time is None or not streams:
            return last.duration
        return sched.step_time(BatchShape.build(decode_contexts=streams)) * sched.step_time_scale

    def _finish(self, name: str, run: "_Run") -> list[RequestOutput]:
        engine = self.engines[name]
        outputs = run.outputs
        self._turn_since_step = False
        self._since[name] = end = time.monotonic()
        self.last_model, self.last_step = name, engine.last_step
        last = self.last_step
        if last is not None and last.num_decode_tokens > 0 and last.num_prefill_tokens == 0:
            self._decode_s[name] = last.duration
        # start and end are wall times (a sliced step's span holds the steps run inside it), the CPU its own
        self.recent_steps.append((name, run.start, end, run.cpu, last.num_decode_tokens if last else 0,
                                  last.num_prefill_tokens if last else 0))
        debut = self._debut.get(name)
        if debut is not None:
            debut.mark("first_step_end", end)
            if any(out.new_token_ids for out in outputs):
                debut.mark("first_token", end)
                del self._debut[name]
                debut.steps = self.steps_since(debut.start - SWITCH_STEPS_BEFORE_S, debut.start)
                debut.finish()
        for request_id in self._deferred_aborts.pop(name, []):
            engine.abort(request_id)
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        self._pace_prefaults()
        return outputs

    def _pace_prefaults(self) -> None:
        """Every model's KV pool prefault (engine/prefault.py) populates only while the whole loop has nothing to
        run. Why: an Engine paces its own pool by its own requests (Engine._pace_prefault), so an idle model's pool
        was populated beside the other model's steps, which then ran slower. In the benchmark's traffic right after a
        start (2026-11-24 15:43 UTC step log, `/tmp` instrumentation), float32 steps while the idle int4 model's
        prefault was free to run took 146-181 ms of their own against a 120 ms target: four of float32's eight
        largest gaps. In the served A/B (16:06 UTC) float32's and int4's p99 gaps were 1.30x and 1.35x alone
        without this, 1.02x and 1.13x with it (benchmarks/summaries/multi_model.md, run V)."""
        if not LOOP_PREFAULT:
            return
        go = not self.has_unfinished()
        for engine in self.engines.values():
            event = getattr(engine, "prefault_go", None)
            if event is None:
                continue
            if go:
                event.set()
            else:
                event.clear()

    def steps_since(self, since: float, origin: float) -> list[tuple]:
        """The recorded steps that ended after `since`, their times in seconds after `origin`."""
        return [(m, round(a - origin, 4), round(b - origin, 4), round(c, 4), d, p)
                for m, a, b, c, d, p in tuple(self.recent_steps) if b > since]  # a copy: the log reads it elsewhere

    # ---- the policy -----------------------------------------------------------------------------------------------

    def pick(self, busy: list[str], now: float) -> str:
        """The model whose batch runs next (see the module docstring)."""
        def key(name: str) -> tuple:
            waited = now - self._since.get(name, now)
            if waited >= self.risk_s:
                return (0, -waited)
            return (1, best_priority(self.engines[name]), -waited)
        return min(busy, key=key)

    def _share_step_target(self, busy: list[str], sliced: bool = False) -> None:
        # Every busy model counts, not only those with running streams: a model whose requests all still wait for
        # their first chunk takes a step in the rotation too, and with a whole target to itself that one step
        # (a prompt chunk) was what stretched the other models' gaps (p99 TBT 1.59x alone, 2026-11-23).
        # With no stream running anywhere there is no gap to protect: each model keeps its whole target.
        # The scheduler's own config: under auto batch settings it is a copy of the engine's.
        # A model loading on demand takes its turns in the rotation too (LoadTurns), so it counts from the start
        # of its load: the other models' prompt chunks shrink to their share before its first turn.
        loading = 1 if self.turns.pending else 0
        shares = len(busy) + loading if any(self.engines[name].scheduler.running for name in busy) else 1
        if sliced and shares > 1:
            # sliced, a step holds one step of each other streaming model per SLICE_DUE x that step of its own
            # work: its wall time is about (1 + 1 / SLICE_DUE) x its own with one other model, and its own streams
            # wait for all of it
            shares = 1 + (shares - 1) / SLICE_DUE
        for name in busy:
            config = self.engines[name].scheduler.config
            if self._step_ms[name] > 0:
                target = self._step_ms[name]
                if sliced and shares > 1 and SLICE_TAIL:
                    # its tail, suspended before when the other models come due during it (SLICE_TAIL), waits for
                    # one more step of each other streaming model: that much less of the target is its own
                    others = sum(self._stream_step_s(o) for o in busy if o != name and has_streams(self.engines[o]))
                    target = max(target / 2, target - 1e3 * others)
                config.max_step_ms = target / shares
                if loading and LOAD_TURN_TARGET:
                    # its streams wait for a load's turn between two of its steps: the step gets what the gap
                    # its streams keep alone leaves beside the last turn. Why: float32 steps of a decode and a
                    # 17-18-token chunk (54-65 ms, half the whole target) with a 35 ms turn between them made its
                    # streams' gaps 96-110 ms against their p99 of 79 ms (2026-11-29 10:05 UTC switch run); a young
                    # prompt then waits (defer_prompt_s, _start)
                    room = 1e3 * (self._gap_alone_s(name) - self._turn_s)
                    config.max_step_ms = max(1.0, min(config.max_step_ms, room))

    def _foreign_step_s(self, name: str | None, busy: list[str]) -> float:
        """Seconds of one step of a model with no streams of its own (`name`, or a load's turn when None) that
        keep the other models' stream gaps within the step-time target: the largest target less the other busy
        models' next steps (the last one, or their share of the target when a prompt of theirs waits for its
        chunk, which may take that much), never less than one share. 0 when no model has a target."""
        own = max((self._step_ms[m] for m in busy + ([name] if name else [])), default=0.0)
        if own <= 0:
            return 0.0
        others = [m for m in busy if m != name]
        k = len(others) + 1
        taken_ms = 0.0
        for m in others:
            engine = self.engines[m]
            last = 1e3 * engine.last_step.duration if engine.last_step is not None else own / k
            prompt_waits = bool(engine.scheduler.waiting) or any(not r.is_decoding for r in engine.scheduler.running)
            taken_ms += max(last, own / k) if prompt_waits else last
        return max(own / k, own - taken_ms) / 1e3

    def _cap_budget(self, name: str, busy: list[str]) -> None:
        """Lower `name`'s token budget for this step to the prompt tokens that fit its share of the step-time
        target while another busy model has streams (see the module docstring); its own budget otherwise."""
        sched = self.engines[name].scheduler
        config = sched.config
        if config.auto_max_num_batched_tokens:  # the scheduler sizes the budget from the (shared) target itself
            return
        own = self._budget[name]
        others_stream = any(has_streams(self.engines[other]) for other in busy if other != name)
        if not others_stream or config.max_step_ms <= 0 or sched.step_time is None:
            config.max_num_batched_tokens = own
            return
        # not cached: the limit moves with the step-time scale and the model is refitted live (a ~9-call bisection)
        fit = prompt_tokens_within(sched.step_time, config.max_step_ms / 1000.0 / sched.step_time_scale, own,
                                   sched.block_size)
        # the model's own decodes always fit in: the scheduler cuts its prompt chunks around them
        config.max_num_batched_tokens = min(own, max(fit, len(sched.running) + sched.block_size))


@dataclass
class _Run:
    """One model's step under way: its generator (Engine.step_iter), when it began (wall), its own CPU so far."""
    gen: Generator[None, None, list[RequestOutput]] | None
    sliced: bool
    start: float
    cpu: float = 0.0
    outputs: list[RequestOutput] = field(default_factory=list)
    boundaries: int = 0  # layer boundaries passed so far
    own_s: float = 0.0  # wall time it ran (not suspended) before this call (SLICE_SPAN)
    predicted_s: float | None = None  # its own time, as the step-time model predicts it once scheduled (SLICE_SPAN)
    lone: bool = False  # the only busy model's step of prompts alone, sliced for a load or a newcomer (LONE_SLICED)
    steps_before: int | None = None  # its scheduler's step count before it was scheduled: tells that it was
    future: concurrent.futures.Future | None = None  # a lane's forward on its worker thread (LANES)


def _lane_forward(runner: ModelRunner, out: Any, threads: int, nice: int) -> tuple[Any, float, float]:
    """On a lane worker: the step's forward on `threads` OpenMP threads (half the engine's: the other lane has the
    other half) at CPU priority `nice` (LANE_NICE); its result, the worker's CPU seconds and when it ended."""
    set_step_threads(threads)
    set_nice(nice)
    cpu = time.thread_time()
    result = runner.execute(out)
    return result, time.thread_time() - cpu, time.monotonic()


def _forward_end(future: concurrent.futures.Future) -> float:
    """When a lane's finished forward ended (one that raised: first, its step fails its requests at once)."""
    return future.result()[2] if future.exception() is None else 0.0


def sliceable(engine: Engine) -> bool:
    """Whether a step of this engine may be suspended between layers: a plain Engine on the single-process runner,
    no speculative decoding (its proposals and verification are one unit of work) and no hooks in its step
    (the fault injector wraps step and execute: it sees whole steps only)."""
    runner = engine.runner
    return (type(engine) is Engine and engine.speculative_config is None and type(runner) is ModelRunner
            and runner.drafter is None and "step" not in vars(engine) and "execute" not in vars(runner))


def has_streams(engine: Engine) -> bool:
    """Whether any request of the engine is past its prompt (a stream whose next token someone waits for)."""
    return any(r.num_output_tokens > 0 for r in engine.scheduler.running)


def prompt_tokens_within(step_time: Any, limit_s: float, most: int, least: int) -> int:
    """The most prompt tokens (one fresh chunk, between `least` and `most`) of a step predicted to take at most
    limit_s; `least` when even that does not fit (prompts must progress)."""
    return largest_that_fits(lambda k: step_time(BatchShape.build(chunks=[(0, k)])) <= limit_s, least, most)


def best_priority(engine: Engine) -> int:
    """The lowest priority value among a model's unfinished requests (lower runs first, as in vLLM)."""
    return min((r.priority for r in engine.scheduler.requests.values()), default=0)
