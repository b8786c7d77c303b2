"""Running a sweep: each configuration in a fresh process group, faults recorded, resumable.

A configuration runs either on spawned local ranks (:func:`commlab.launch`) or as one ``torchrun``
job (so the same sweep runs across nodes). Either way it gets its own process group and its own
deadline: a crash or a hang is recorded as the configuration's status and error, its processes
are ended, and the sweep goes on. Each finished configuration is saved atomically before the
next one starts, so ``--resume`` continues a killed sweep without losing or repeating rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import commlab
from commlab.runtime.orphans import dies_with_parent, private_tempdir
from commlab.sweep import wrap
from commlab.runs import store
from commlab.sweep.progress import Progress
from commlab.runs.config import Config
from commlab.runs.grid import Grid

Echo = Callable[[str], None]


def check_grid(plan: Grid) -> None:
    """Environment checks that need torch (models, algorithms, devices); ValueError on failure."""
    from commlab.collectives import algorithm_names
    from commlab.models import SIZES, build_workload, check_workload
    from commlab.runtime import resolve_backend
    from commlab.runtime.capacity import check_cpu_capacity
    from commlab.sharded.comm import ALGORITHMS as SHARDED_ALGORITHMS

    built: set[tuple[str, str]] = set()
    for cfg in plan.configs:
        check_workload(cfg.model, **cfg.model_kwargs())
        if cfg.model in SIZES and (cfg.model, cfg.model_args) not in built:
            # Built-in models are cheap to build once here, and sizes that do not fit together
            # (say d_model not divisible by heads) then fail now rather than on every rank.
            try:
                build_workload(cfg.model, **cfg.model_kwargs())
            except Exception as err:
                raise ValueError(f"--model {cfg.model} --model-args {cfg.model_args}: {err}") from None
            built.add((cfg.model, cfg.model_args))
        if cfg.tp > 1:
            check_tensor_parallel(cfg)
        if cfg.pp > 1:
            from commlab.sweep.pipelined import check_pipeline

            check_pipeline(cfg)
        if not cfg.zero_stage.ddp and cfg.algorithm not in SHARDED_ALGORITHMS:
            raise ValueError(f"--algorithm {cfg.algorithm} --stage {cfg.stage}: sharded stages need a reduce-scatter "
                             f"and an all-gather, which these provide: {', '.join(SHARDED_ALGORITHMS)}")
        if cfg.algorithm not in algorithm_names():
            raise ValueError(f"--algorithm: unknown all-reduce algorithm {cfg.algorithm!r}: choose from {', '.join(algorithm_names())}")
        try:
            resolve_backend(cfg.backend, cfg.world_size // plan.nnodes)
        except ValueError as err:
            raise ValueError(f"--backend/--world-size: {err}") from None
        if cfg.backend == "gloo":  # CPU ranks: each node hosts world_size / nnodes of them
            try:
                check_cpu_capacity(cfg.world_size // plan.nnodes, cfg.threads)
            except ValueError as err:
                raise ValueError(f"--world-size {cfg.world_size} --threads {cfg.threads}: {err}") from None


def check_tensor_parallel(cfg: Config) -> None:
    """A tensor-parallel layout the model can take: the GPT's plan resolved at ``cfg.tp`` (pure,
    commlab.tensor.resolve), so that tp not dividing the heads or features fails before any rank."""
    from commlab.models import build_workload
    from commlab.tensor import gpt_plan, resolve

    if cfg.model != "gpt":
        raise ValueError(f"--tp {cfg.tp} --model {cfg.model}: tensor parallelism in a sweep splits the built-in "
                         "GPT by its plan (commlab.tensor.gpt_plan); use --model gpt")
    try:
        resolve(build_workload(cfg.model, **cfg.model_kwargs()).model, gpt_plan(), cfg.tp)
    except ValueError as err:
        raise ValueError(f"--tp {cfg.tp} --model {cfg.model} --model-args {cfg.model_args or '(defaults)'}: {err}") from None


def measure_config(cfg: Config, plan: Grid) -> list[dict[str, Any]]:
    """All ranks' results for one configuration; raises on a crash, a hang or a timeout."""
    if plan.launcher == "local":
        from commlab.sweep.worker import measure

        return commlab.launch(measure, cfg, world_size=cfg.world_size, backend=cfg.backend, timeout=plan.timeout)
    return _torchrun(cfg, plan)


def _torchrun(cfg: Config, plan: Grid) -> list[dict[str, Any]]:
    with private_tempdir("commlab-sweep-") as tmp:
        config_path, result_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        config_path.write_text(json.dumps(cfg.columns()))
        cmd = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={cfg.world_size // plan.nnodes}", f"--nnodes={plan.nnodes}"]
        if plan.rdzv_endpoint:
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={plan.rdzv_endpoint}", f"--rdzv-id={cfg.id}"]
        else:
            cmd += ["--standalone"]
        cmd += ["-m", "commlab.sweep.worker", str(config_path), str(result_path), str(plan.timeout)]
        # A new session so that a timeout can end torchrun and every rank it started; torchrun
        # dies with this process if it is killed outright.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=dies_with_parent())
        try:
            output, _ = proc.communicate(timeout=plan.timeout + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TimeoutError(f"torchrun did not finish within {plan.timeout:g} s") from None
        except BaseException:  # Ctrl-C or SIGTERM: torchrun is in its own session, end it too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if proc.returncode != 0 or not result_path.exists():
            errors = sorted(Path(tmp).glob("result.json.rank*.error"))
            detail = "\n".join(f"--- {p.name.split('.')[2]} ---\n{p.read_text()}" for p in errors) or output[-4000:]
            raise RuntimeError(f"torchrun exited with code {proc.returncode}\n{detail}")
        return json.loads(result_path.read_text())


def order(configs: tuple[Config, ...] | list[Config], repeat: int) -> list[tuple[int, Config]]:
    """(repetition, configuration) pairs in run order: the grid forward, then backward, ...

    A machine's speed drifts over minutes (20-30% over a grid here), so a single pass turns the
    drift into a trend across the grid. Alternating the direction puts each configuration early
    in one repetition and late in the next, so a steady drift raises every configuration's
    median alike; unlike a shuffle it keeps the pairs a figure compares (overlap on/off,
    innermost in the grid) back to back in every repetition.
    """
    return [(r, cfg) for r in range(repeat) for cfg in (configs if r % 2 == 0 else configs[::-1])]


def run(plan: Grid, run_dir: Path, *, resume: bool, echo: Echo, write: bool = True,
        measure: Callable[[Config, Grid], list] = measure_config) -> list[dict[str, Any]]:
    """Run every (repetition, configuration) of ``plan`` not already finished; return new records.

    ``write=False`` (the drivers of nodes other than node 0 in a multi-node sweep) runs the same
    configurations in step with node 0 but leaves the results directory to node 0.
    """
    runs = order(plan.configs, plan.repeat)
    done = store.finished_ids(run_dir) if resume else set()
    todo = [(r, c) for r, c in runs if (c.id, r) not in done]
    if done:
        echo(f"resuming {run_dir}: {len(runs) - len(todo)} of {len(runs)} configurations already finished")
    progress = Progress(len(todo), echo)
    new = []
    for rep, cfg in todo:
        echo(f"  running {cfg.id}" + (f" (repetition {rep + 1}/{plan.repeat})" if plan.repeat > 1 else "") + " ...")
        started = time.time()
        try:
            results = measure(cfg, plan)
            rec = store.record(cfg, started, results, measures=wrap.summary(results), repetition=rep)
        except Exception as err:  # a failed configuration is a result too; the sweep goes on
            status = "timeout" if ("did not finish within" in str(err) or isinstance(err, TimeoutError)) else "failed"
            rec = store.record(cfg, started, None, measures=wrap.summary([]), error=_short(err), status=status,
                               repetition=rep)
        if write:
            store.save_record(run_dir, rec)
            _, _, table = store.assemble(run_dir)
        else:
            _, _, table = store.tables([rec])
        new.append(rec)
        progress.advance(summary_line(table[table["config"] == cfg.id].iloc[0]))
    if write and not todo:
        store.assemble(run_dir)
    return new


def summary_line(row) -> str:
    """One line per finished configuration, for the console: the median step (per iteration the
    slowest rank's; the statistic of every figure, commlab.runs.stats.median_step), its q1-q3,
    and the exposed communication inside that step."""
    if row["status"] != "ok":
        first = str(row["error"]).strip().splitlines()[0] if str(row["error"]).strip() else ""
        return f"{row['config']}  {row['status'].upper()}  {first[:120]}"
    return (
        f"{row['config']}  median step {row['step_median'] * 1e3:.1f} ms "
        f"(q1-q3 {row['step_q1'] * 1e3:.1f}-{row['step_q3'] * 1e3:.1f}), of which exposed comm "
        f"{row['exposed_comm_median'] * 1e3:.1f} ms  {row['samples_per_s']:.0f} samples/s"
        + (f"  peak {_size(row['peak_bytes'])}" if _known(row.get("peak_bytes")) else "")
    )


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _known(value) -> bool:
    return value is not None and value == value  # not missing, not NaN


def _short(err: BaseException) -> str:
    """The error with the failing rank's traceback, capped so that runs.csv stays readable."""
    text = f"{type(err).__name__}: {err}"
    return text if len(text) < 4000 else text[:1000] + "\n...\n" + text[-3000:]
