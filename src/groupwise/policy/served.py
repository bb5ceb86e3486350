"""``rollout.backend = "server"``: rollouts sampled by generation servers (``groupwise serve``, or any
server speaking its protocol), weights pushed after updates, and asynchronous generation held to
``train.max_staleness`` policy versions.

The design follows the anchors' asynchronous GRPO (TRL 1.18 ``AsyncGRPOTrainer``, ``max_staleness``;
verl / prime-rl's off-policy bound; SkyRL): generation runs on a server the trainer feeds with new
weights, up to k versions ahead of the update, and the sampler/trainer correction (``sampler_is``,
Yao et al. 2025, https://fengyao.notion.site/off-policy-rl) re-weights what the lag changed.

**Versions.** The policy's version is the number of RL steps whose update it has taken (step t
trains on version t). Weights go to every server as a state-dict file on ``/dev/shm`` when it exists
(else the temp folder) named in ``POST /v1/load_weights``. At k = 0, ``rollout.push_every = p`` pushes
after each p-th update, so rows are up to p − 1 versions stale (the bound rows are checked against;
p > 1 adds ``sampler_is`` as k > 0 does). Every row is tagged with the version the server sampled it
under (row extra ``policy_version``), and its staleness is ``t − version``.

**Asynchrony** (``train.max_staleness = k > 0``): step t's first generation call (round 0) is
sampled under version ``max(0, t − k)`` (a fixed lag: the same rows on every run), submitted as soon
as that version exists, so it is generated while steps t − k .. t − 1 train. Its requests are
foreseen by running the rollout strategy for step t against copies of the prompt sampler (the draw
only: the strategy is stopped at its first generation call); when step t's real first call asks for
other requests (a sampler that learns from the steps in between), they are generated then, under
the current weights, and counted (``async/miss``; a strategy that cannot be run ahead:
``async/unforeseen``). One worker thread feeds the servers in order: before each job it loads the
job's version (kept as a file until no pending job needs it). Rows staler than k are dropped
(``group_valid`` false; ``async/dropped``): with the fixed lag none are expected; the check guards
against a server that answers under another version than asked (restarted, or fed by someone else).
``staleness/<s>`` logs each step's rows per staleness.
``k = 0`` generates each step's batch in the step, under its own weights: today's synchronous step.

**Resume** is exact by checkpointing the in-flight rollouts: ``rollout_state`` waits for every
submitted job and stores its rows with the requests they answer; a resumed run takes them instead of
generating again (regenerating would need the older weights they were sampled under).

``rollout.servers = []`` starts one local ``groupwise serve`` process with the run's model and
``perf`` settings and ``rollout.server_threads`` torch threads; it ends with the run.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from groupwise.errors import ConfigError
from groupwise.policy.engine import GenerationOutput
from groupwise.types import Request, Rollout


class ServerError(RuntimeError):
    """A generation server refused or failed a request."""


def post(url: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    """POST ``body`` as JSON; the JSON answer, or ``ServerError`` with the server's own message."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except Exception:
            message = str(err)
        raise ServerError(f"{url}{path}: HTTP {err.code}: {message}") from None
    except urllib.error.URLError as err:
        raise ServerError(f"{url}{path}: no answer ({err.reason}); is the server running?") from None


class RemoteEngine:
    """``CPUEngine.generate``'s contract over HTTP: the prompts are split over the servers in
    contiguous shards (load balancing), each shard one ``/v1/completions`` request carrying its
    rows' seeds (``row_seeds``), so a row's tokens do not depend on the split (its log-probs only to the
    float rounding of another batch shape). ``calls``: per call,
    the version each prompt's rows were sampled under ([B])."""

    hooks = frozenset()  # a generation hook (groupwise.hooks) cannot cross the wire

    def __init__(self, urls: list[str], pad_token_id: int):
        self.urls, self.pad = list(urls), int(pad_token_id)
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))
        self.calls: list[torch.Tensor] = []  # [B] per call: the version each prompt's rows were sampled under

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        row_seeds: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        hooks: list | None = None,
    ) -> GenerationOutput:
        if hooks is not None and any(h is not None for h in hooks):
            raise ValueError("generation hooks cannot be applied by a generation server; use rollout.backend='local'")
        B = len(prompt_ids)
        seeds = row_seeds.tolist()  # [B*n]
        bounds = [round(i * B / len(self.urls)) for i in range(len(self.urls) + 1)]
        body = {
            "n": n,
            "max_tokens": int(max_new_tokens),
            "temperature": 0.0 if greedy or temperature <= 0 else float(temperature),
            "top_p": float(top_p),
            "top_k": int(top_k),
            "logprobs": 0,
            "return_token_ids": True,
        }
        shards = [(url, lo, hi) for url, lo, hi in zip(self.urls, bounds[:-1], bounds[1:]) if hi > lo]
        jobs = [
            self.pool.submit(
                post,
                url,
                "/v1/completions",
                {**body, "prompt": [list(p) for p in prompt_ids[lo:hi]], "row_seeds": seeds[lo * n : hi * n]},
            )
            for url, lo, hi in shards
        ]
        choices, versions = [], []
        for job, (_, lo, hi) in zip(jobs, shards):
            answer = job.result()
            choices += answer["choices"]
            versions += [answer["policy_version"]] * (hi - lo)
        T = max(len(c["token_ids"]) for c in choices)
        tokens = torch.full((B * n, T), self.pad, dtype=torch.long)  # [B*n,T]
        logp = torch.zeros(B * n, T)  # [B*n,T]
        lengths = torch.zeros(B * n, dtype=torch.long)  # [B*n]
        truncated = torch.zeros(B * n, dtype=torch.bool)  # [B*n]
        for r, c in enumerate(choices):
            ids = c["token_ids"]
            tokens[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp[r, : len(ids)] = torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float32)
            lengths[r], truncated[r] = len(ids), c["finish_reason"] == "length"
        self.calls.append(torch.tensor(versions, dtype=torch.long))  # [B]
        return GenerationOutput(
            tokens=tokens.reshape(B, n, T),  # [B,n,T]
            lengths=lengths.reshape(B, n),  # [B,n]
            truncated=truncated.reshape(B, n),  # [B,n]
            logp=logp.reshape(B, n, T),  # [B,n,T]
        )


class LocalServer:
    """A ``groupwise serve`` process on a free port of this machine, ended with the run."""

    def __init__(self, model: str, overrides: list[str], threads: int):
        folder = tempfile.mkdtemp(prefix="groupwise-serve-")
        port_file = Path(folder) / "url"
        overrides = [f"threads={threads}", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        src = str(Path(__file__).resolve().parents[2])  # this groupwise's sources first, as in this process
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        self.log = open(Path(folder) / "serve.log", "w")  # noqa: SIM115 (open while the process runs)
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "groupwise", "serve", model, "--port-file", str(port_file)),
                *("--parent-pid", str(os.getpid()), *overrides),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        atexit.register(self.close)
        deadline = time.time() + 300
        while not port_file.exists():
            if self.process.poll() is not None or time.time() > deadline:
                self.close()
                raise ServerError(
                    f"the local generation server did not start (log: {Path(folder) / 'serve.log'}): "
                    + (Path(folder) / "serve.log").read_text()[-2000:]
                )
            time.sleep(0.05)
        self.url = port_file.read_text().strip()
        while True:  # the port is bound before uvicorn answers: wait for /health
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.time() > deadline:
                    self.close()
                    raise ServerError("the local generation server exited before answering /health") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


class _Foreseen(Exception):
    """Stops a strategy run ahead at its first generation call (``ServedPolicy.foresee``)."""

    def __init__(self, requests: list[Request], sampling: dict):
        super().__init__()
        self.requests, self.sampling = requests, sampling


def _signature(requests: list[Request], sampling: dict) -> tuple:
    """What a generation call asks for: each request's prompt, key, rows and sample offset; the sampling."""
    return (
        tuple((tuple(r.prompt), r.key, r.n, r.offset) for r in requests),
        tuple(sorted(sampling.items())),
    )


class ServedPolicy:
    """The policy as the rollout stage sees it under ``rollout.backend = "server"``: everything is the
    policy's own (``__getattr__``) except ``generate``, which samples on the servers, and the hooks
    (none cross the wire). The trainer calls ``after_step(trainer)`` after each step's update."""

    hooks = frozenset()

    def __init__(self, policy: Any, cfg: Any, server_args: list[str] = ()):
        if getattr(policy, "modality", None) != "text" or not hasattr(policy, "engine"):
            raise ConfigError(
                f"rollout.backend='server' serves a text LM policy; model.policy={cfg.model.policy!r} generates in the "
                f"trainer: use rollout.backend='local'"
            )
        self.policy, self.cfg = policy, cfg
        self.server_args = list(server_args)  # model.* / perf.* overrides of a local server: the run's own model
        self.k, self.push_every = int(cfg.train.max_staleness), int(cfg.rollout.push_every)
        self.bound = max(self.k, self.push_every - 1)  # the staleness a row may have: the lag, or the push period
        self._local: LocalServer | None = None
        self._remote: RemoteEngine | None = None
        self.version = 0  # the trainer's policy version: the number of updates taken
        self.server_version: int | None = None  # what the servers hold (the worker's view; None: not pushed yet)
        self.files: dict[int, str] = {}  # version -> its weights' file, while a job may need it
        self.worker = ThreadPoolExecutor(max_workers=1)  # pushes and generations, in submission order
        self.pending: dict[int, tuple[tuple, Future]] = {}  # step -> (signature, future (rollout, versions [B]))
        self.stats: Counter = Counter()
        shm = Path("/dev/shm")
        self._folder = Path(tempfile.mkdtemp(prefix="groupwise-weights-", dir=shm if shm.is_dir() else None))

    def __getattr__(self, name: str) -> Any:
        if "policy" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["policy"], name)

    # ------------------------------------------------------------------ servers and weights
    @property
    def remote(self) -> RemoteEngine:
        """The servers (the local one started on first use when ``rollout.servers`` is empty)."""
        if self._remote is None:
            urls = [u.rstrip("/") for u in self.cfg.rollout.servers]
            if not urls:
                t0 = time.perf_counter()
                self._local = LocalServer(self.cfg.model.path, self.server_args, self.cfg.rollout.server_threads)
                self.stats["serve/start_seconds"] += time.perf_counter() - t0  # logged with the first step
                urls = [self._local.url]
            self._remote = RemoteEngine(urls, self.policy.tokenizer.pad_token_id)
        return self._remote

    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)
        if self._local is not None:
            self._local.close()
        for path in self.files.values():
            Path(path).unlink(missing_ok=True)

    def _snapshot(self, version: int) -> None:
        """The current weights, as version ``version``'s file (torch.save keeps tied weights tied)."""
        if version not in self.files:
            path = self._folder / f"v{version}.pt"
            torch.save({k: v.detach().cpu() for k, v in self.policy.module.state_dict().items()}, path)
            self.files[version] = str(path)

    def _load(self, version: int) -> None:
        """Every server holds ``version`` (run by the worker)."""
        if self.server_version == version:
            return
        for url in self.remote.urls:
            answer = post(url, "/v1/load_weights", {"path": self.files[version], "version": version})
            if answer["version"] != version:
                raise ServerError(f"{url} loaded version {answer['version']}, asked for {version}")
        self.server_version = version
        self.stats["serve/pushes"] += 1

    def _prune(self) -> None:
        """Drop the weight files that no unfinished job needs (the current version's stays)."""
        needed = {self.version} | {max(0, t - self.k) for t, (_, job) in self.pending.items() if not job.done()}
        for v in [v for v in self.files if v not in needed]:
            Path(self.files.pop(v)).unlink(missing_ok=True)

    def _job(self, requests: list[Request], sampling: dict, info: Any, version: int | None) -> tuple:
        """(rollout, versions [B]) of one generation call, under ``version`` (None: what the servers hold)."""
        if version is not None:
            self._load(version)
        self.remote.calls = []
        out = self.policy.generate(requests, sampling, info, engine=self.remote)
        versions = torch.zeros(len(requests), dtype=torch.long)  # [B] LMPolicy.generate: one call per distinct n
        for call, n in zip(self.remote.calls, sorted({r.n for r in requests})):
            versions[[i for i, r in enumerate(requests) if r.n == n]] = call
        return out, versions

    # ------------------------------------------------------------------ the rollout stage's call
    def generate(self, requests: list[Request], sampling: dict, info: Any) -> Rollout:
        """The rows of these requests, sampled on the servers: step t's first call from what was
        submitted ahead (``max_staleness`` > 0) when it asks for the foreseen requests, else now."""
        self.remote  # noqa: B018 (a local server starts here, on the trainer's thread)
        ahead = self.pending.pop(info.step, None) if info.round == 0 else None
        if ahead is not None and ahead[0] == _signature(requests, sampling):
            out, versions = ahead[1].result()
        else:
            if ahead is not None:
                self.stats["async/miss"] += 1
            self.version = max(self.version, info.step)  # resumed: the weights are version `step`
            version = None
            if self.server_version is None or self.k > 0:  # first call, or a miss: the current weights
                self._snapshot(self.version)
                version = self.version
            out, versions = self.worker.submit(self._job, requests, sampling, info, version).result()
        return self._tag(out, versions, info.step)

    def _tag(self, out: Rollout, versions: torch.Tensor, step: int) -> Rollout:
        """Rows tagged with their version; rows staler than the bound (k, or ``push_every − 1`` at k = 0)
        dropped and counted; the histogram."""
        G = out.shape[1]
        out.set_extra("policy_version", versions[:, None].expand(-1, G).float().clone(), "row")  # [B,G]
        staleness = step - versions  # [B]
        stale = staleness > self.bound  # [B]
        if bool(stale.any()):
            self.stats["async/dropped"] += int(out.group_valid[stale].sum())
            out.group_valid = out.group_valid & ~stale[:, None]  # [B,G]
        for s, rows in zip(staleness.tolist(), out.group_valid.sum(-1).tolist()):
            if rows:
                self.stats[f"staleness/{s}"] += rows
        return out

    # ------------------------------------------------------------------ after each update: push, submit ahead
    def after_step(self, trainer: Any) -> None:
        """Step ``trainer.step`` took its update: version ``step + 1`` exists. k = 0: pushed every
        ``push_every`` updates. k > 0: every step up to ``step + 1 + k`` not yet submitted is foreseen
        and submitted under version ``max(0, t − k)``, behind every earlier job."""
        self.version = trainer.step + 1
        if self.k == 0:
            if self.version % self.push_every == 0:
                self._snapshot(self.version)
                self.worker.submit(self._load, self.version).result()
        else:
            self._snapshot(self.version)
            for t in range(trainer.step + 1, min(self.version + self.k, trainer.cfg.train.steps - 1) + 1):
                if t not in self.pending:
                    self._submit_ahead(trainer, t, max(0, t - self.k))
        self._prune()

    def _submit_ahead(self, trainer: Any, step: int, version: int) -> None:
        if version not in self.files:  # an older version than any kept: that step is generated when it comes
            self.stats["async/unforeseen"] += 1
            return
        foreseen = self.foresee(trainer, step)
        if foreseen is None:
            self.stats["async/unforeseen"] += 1
            return
        requests, sampling = foreseen
        job = self.worker.submit(self._job, requests, sampling, _info_at(trainer, step)(0), version)
        self.pending[step] = (_signature(requests, sampling), job)

    def foresee(self, trainer: Any, step: int) -> tuple[list[Request], dict] | None:
        """Step ``step``'s first generation call as the strategy will make it: the strategy runs on a
        copy of the prompt sampler advanced through the steps before it (their first calls' draws) and
        stops at its first generation call. None when it cannot be foreseen."""
        from groupwise.rollout.context import RolloutContext

        sampler, found = copy.deepcopy(trainer.sampler), None
        for s in range(trainer.step + 1, step + 1):
            ctx = RolloutContext(
                _Recorder(self.policy),
                sampler,
                trainer.reward_stage,
                lambda rollout: None,
                lambda i: trainer.prompts("train", trainer.train_rows, i),
                lambda i: trainer.train_rows[i],
                _info_at(trainer, s),
                trainer.sampling_params,
                trainer.cfg.rollout.prompts_per_step,
                trainer.cfg.rollout.group_size,
            )
            try:
                copy.deepcopy(trainer.strategy)(ctx)
                return None  # the strategy generated nothing
            except _Foreseen as seen:
                found = (seen.requests, seen.sampling)
            except Exception:  # a strategy that cannot run ahead: its steps are generated when they come
                return None
        return found

    # ------------------------------------------------------------------ logs and checkpoints
    def pop_stats(self) -> dict[str, float]:
        """This step's counts: rows per staleness, dropped rows, misses, pushes."""
        out = {k: float(v) for k, v in sorted(self.stats.items())}
        self.stats.clear()
        return out

    def rollout_state(self) -> dict[str, Any]:
        """The in-flight rollouts, waited for: a resumed run takes them as they were sampled."""
        state = {}
        for step, (signature, job) in self.pending.items():
            out, versions = job.result()
            fields = {f: getattr(out, f) for f in _ROLLOUT_FIELDS}
            state[step] = {"signature": signature, "rollout": fields, "versions": versions}
        return {"pending": state}

    def load_rollout_state(self, state: dict[str, Any], step: int) -> None:
        self.version, self.pending = step, {}
        for t, item in state.get("pending", {}).items():
            done: Future = Future()
            done.set_result((Rollout(**item["rollout"]), item["versions"]))
            self.pending[int(t)] = (item["signature"], done)


_ROLLOUT_FIELDS = ("prompt_ids", "actions", "mask", "group_valid", "truncated", "prompt_index", "logp_sampler")


class _Recorder:
    """The policy for a strategy run ahead: the first generation call stops the run with its requests."""

    def __init__(self, policy: Any):
        self.policy = policy

    hooks = frozenset()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["policy"], name)

    def generate(self, requests: list[Request], sampling: dict, info: Any) -> Rollout:
        raise _Foreseen(requests, sampling)


def _info_at(trainer: Any, step: int):
    """``trainer.info`` as it will be at step ``step``."""
    import dataclasses

    def info(round_: int = 0):
        return dataclasses.replace(trainer.info(round_), step=step)

    return info
