"""A 2-D flow-matching generator as a trainer policy, with Flow-GRPO's SDE step and its log-prob.

Flow-GRPO: "Flow-GRPO: Training Flow Matching Models via Online RL", Jie Liu, Gongye Liu, Jiajun
Liang et al., 2025, https://arxiv.org/abs/2505.05470. Flash-GRPO (one SDE step per rollout,
iso-temporal): arXiv 2605.15980, code https://github.com/Shredded-Pork/Flash-GRPO
(``flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob2.py``), spec 14-flash-grpo.md.

**Change vs GRPO**: the "tokens" are denoising steps. A rollout row is one 2-D sample drawn by an
Euler sampler from x ~ N(0, I) at σ = 1 down to σ = 0; the steps run as SDE steps (stochastic,
with a Gaussian log-prob: the policy's actions) are the trained ones, the others are ODE steps.

**Math** (step i: ``σ = sigmas[i]``, ``σ' = sigmas[i+1]``, ``dt = σ' − σ < 0``; D = ``dim`` dims, 2 by default)::

    sigmas  = shift·u / (1 + (shift − 1)·u),   u = linspace(1, 0, steps + 1)
    ODE:      x' = x + v_θ(x, σ, label)·dt
    SDE:      std_t = σ_min + (σ_max − σ_min)·σ          σ_max = sigmas[1], σ_min = sigmas[-1]
              mean  = x(1 + std_t²/(2σ)·dt) + v_θ(1 + std_t²(1−σ)/(2σ))·dt
              x'    = mean + std_t·√(−dt)·ε,   ε ~ N(0, I)
              logp  = mean_d[ −(x'−mean)²/(2 std_t² (−dt)) − log(std_t √(−dt)) − log √(2π) ]
    c(t)    = √(−dt)/std_t + std_t √(−dt)(1−σ)/(2σ) = |∂logp/∂v| · D / |ε|     (coe = 1/c)

**Defaults**

- ``steps = 10`` [INFERRED] the toy's Euler steps (specs/README Toy-Flow-2D: K = 10); Flash-GRPO
  samples Wan with 20 [CODE].
- ``shift = 1.0`` (linear sigmas) [INFERRED] for the toy; Wan uses ``shift = 3`` [CODE] ``config/dgx.py``
  (with it, 20 steps reproduce the authors' 1/c table to 0.15 %, ``tests/test_flash_grpo.py``).
- ``sde = "one_shared"`` [CODE] Flash-GRPO; ``"all"`` is Flow-GRPO (every step SDE and trained);
  ``"one_per_row"`` [INFERRED] is the spec's ablation (b); ``"none"`` (all ODE, T = 0) is for evaluation.
- ``sde_window = steps // 2`` [CODE] the index is uniform over the first 10 of 20 steps.
- ``hidden = 64``, ``layers = 3`` (2→64→64→2 plus σ and label features) [INFERRED] specs/README toy.
- ``condition = "label"`` [INFERRED] the toy's label embedding (Flash-GRPO's form, bit-for-bit as
  before). ``"embedding"`` is E²PO's CPU implementation (spec 15): each label's prompt is one
  ``embed_dim = 8``-d token [PAPER: the spec's toy] read through a frozen random MLP "text
  encoder" (:class:`PromptEncoder`: 8 → ``encoder_hidden = 32`` tanh → ``cond_dim = 16``
  [INFERRED], seeded by ``encoder_seed = 0``); the velocity net reads the condition through a
  linear map initialised N(0, (2/√cond_dim)²) [INFERRED] (a condition of norm ≈ 2.8 then offsets
  each hidden unit about as much as the label table's N(0, 1)).

**Notes**

1. Seeds: row j of a request samples with ``torch.Generator(sample_seed(seed, step, key, offset + j))``
   (x_1, then ε for every step, then the row's index for ``one_per_row``); the shared index of
   ``one_shared`` uses ``sample_seed(seed, step, key, −1 − offset)`` (negative indices never name a
   row). A request's samples do not depend on the rest of the batch.
2. Contract with weights (token extras [B,G,T(,D)] float32, 0 where ``mask`` is False):
   ``flow_x`` (x before the trained step), ``flow_x_next`` (after it), ``flow_sigma`` (σ),
   ``flow_sigma_next`` (σ'), ``flow_std`` (std_t); ``flow_step`` (int64 step index i). Row extra
   ``x_final`` [B,G,D]: the sample at σ = 0. ``logp_sampler`` holds the log-probs of sampling.
3. ``forward`` recomputes logp of the stored x' given the stored x under the current net (the
   spec's one trainable forward per sample at the selected step); ``x'`` is data, never differentiated.
   The net and the step maths run in float64 and the trajectory is stored in float32 after each
   step, so the recomputation sees exactly the sampler's inputs: in float32 the matmuls round
   differently for different batch sizes, which moved a float32 recomputation's logp by 1.2e-6 at
   σ = 0.2 (noise scale std·√(−dt) = 0.057).
4. ``sampling`` (temperature, max_new_tokens, ...) is ignored: the SDE noise is fixed by the schedule.
   ``encode(label) -> [label]`` and ``decode(rollout) -> [B][G] "x,y"`` mirror the LM policy's.
5. Generation hooks (``groupwise.hooks``): the embedding form applies ``embed_delta`` (its
   ``hooks``); the label form applies none, so a strategy that samples under one is refused at
   build. Row j of a hooked request samples with C^opt = f(E + δ_j) mixed into C^orig = f(E) per
   step by E²PO's noise-aware schedule, C(σ) = γ(σ)·C^opt + (1 − γ(σ))·C^orig with
   γ = ``hooks.noise_aware_gamma(σ, rho)`` (γ = 1 when the hook's ``rho`` is None); rows
   with δ = 0 read C^orig exactly (bit-identical to unhooked sampling). ``forward`` always reads
   C^orig: the stored trajectory is scored on the original condition (the reference-anchored
   update). ``prompt_encoder()`` is E²PO phase I's view (``phases/e2po_perturb.prompt_space``).
6. Subclasses condition the velocity on more than the label through two hooks: ``_velocity(x, σ,
   label, cond)`` (``cond`` [N,...] per row, from ``_generate_flow``'s ``cond`` [B,G,...]) and
   ``_stored_condition(rollout, sel)`` (the same condition for the stored steps, at training); the
   planner kind (``modalities/planner.py``) passes its plan (latents or think tokens) this way.
7. Demonstrations (the ``sft`` phase, ``Policy.supervised_loss``): the net is fitted by
   rectified flow matching. A point at noise level σ is x_σ = (1 − σ)·x_0 + σ·ε (x_0 the
   demonstration, ε the noise the sampler starts from at σ = 1), so dx_σ/dσ = ε − x_0 is the
   velocity the Euler sampler integrates from σ = 1 down to 0; the loss regresses v_θ(x_σ, σ) on
   it, the mean over rows and the 2 dimensions. ``model.path`` loads a saved policy
   (``policy/kinds.build_policy``: ``<path>/flow_policy.pt``), so a fitted toy is a warm start,
   a frozen role or a teacher.
8. Conditions and shapes (issue 37 M2). ``dim`` (default 2) is the sample dimension D: the net
   maps [D + 1 + 2F] features to [D], the draws, ``x_final`` [B,G,D] and the stored steps have D
   numbers, ``decode`` writes ``"x1,x2,…"``; ``config`` records ``dim`` only when it is not 2, so
   2-D checkpoints load as before. ``condition = "vector"`` (with ``obs_dim``) reads an
   observation: the encoded prompt is then a list of ``obs_dim`` floats, not a label, read by a
   linear map as the embedding form's condition is. ``condition_extras = {name: n}`` are discrete
   conditions the policy reads while sampling from ``Request.extras[name]`` (values 0..n−1, −1 or
   absent = a learned null condition), one embedding table each. What each trained step was
   conditioned on, the observation then the codes, is stored as the token extra ``flow_cond``
   [B,G,T,C+E] (float32; not written by the label and embedding forms without extras), and
   ``forward`` reads it, so a row scores under the condition it was sampled with whatever group
   it ends up in. The label and embedding forms read the label of the row's own context
   (``Rollout.row_contexts``: a strategy's ``ctx``, else the group's prompt), in ``forward`` as in
   the rewards ``flow_region`` / ``flow_trap``.
9. Kernels (issue 37 M3). ``sampler = "euler"`` (above; ``noise = "flash"``, Flash-GRPO's std_t,
   the default, or ``"flow_grpo"``, Flow-GRPO's a·√(σ/(1−σ)) with ``noise_level = a = 0.7`` [CODE]
   ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``, which replaces σ = 1 by σ_max in the
   denominator) or ``"consistency"`` (CM-GRPO, spec 19 [CODE] RAVEN ``consistency.py`` with the
   lerp schedule): x̂₀ = x_t − t·v_θ, x_s = (1 − s)·x̂₀ + s·ε, so π(x_s | x_t) = N((1 − s)·x̂₀, s²I);
   every step is the kernel's draw (ε = 0 when greedy), the last (s = 0) is deterministic and never
   trained (``all`` trains steps − 1; ``sde_window <= steps − 1``). ``cfg_w`` ≠ 0 guides toward the
   ``condition_extras`` condition: v = v_u + w·(v_c − v_u), v_u under the null codes, two velocity
   calls per step in sampling and in ``forward`` alike. A greedy call may override ``sampler``,
   ``steps`` and ``cfg_w`` (``Request.sampling``, ``eval.sampling``: deploy with another kernel);
   a sampled call must use the policy's own, which ``forward`` re-scores. ``forward`` also gives
   ``step_mean`` (the Gaussian step's mean) and ``x0_pred`` (x̂₀ = x − σ·v_θ) [B,G,T,D], with grad
   when asked with grad, for the policy and its frozen snapshot alike (``quantities``).
10. Classifier-free guidance needs a net that knows both velocities, v(x, σ, c) and v(x, σ, ∅)
    (Ho & Salimans 2022, "Classifier-Free Diffusion Guidance", https://arxiv.org/abs/2207.12598;
    DIAL, spec 26: "classifier-free dropout teaches both conditional and unconditional action
    distributions"). A demonstration of a policy with ``condition_extras`` carries its conditions
    (its row's columns of those names, ``encode_target``), and the fit (``sft`` phase option
    ``p_uncond``) replaces a row's conditions by the null ones with probability ``p_uncond``
    (:func:`cfg_dropout`; the uniform draw per row comes from the fit's generator after σ and ε,
    and only when ``p_uncond > 0``, so a fit without dropout is unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from groupwise.modalities.flow_condition import PromptEncoder, hooked_conditions, mixed_condition
from groupwise.modalities.flow_sde import (
    NOISE_SCHEDULES,
    consistency_step,
    flow_sigmas,
    row_labels,
    sde_step_with_logprob,
)
from groupwise.modalities.gauss import cfg_velocity
from groupwise.modalities.net_policy import NetPolicy
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

SDE_MODES = ("all", "one_shared", "one_per_row", "none")
CONDITIONS = ("label", "embedding", "vector")
SAMPLERS = ("euler", "consistency")
QUANTITIES = frozenset({"logp", "entropy", "step_mean", "x0_pred"})
TOKEN_EXTRAS = ("flow_x", "flow_x_next", "flow_sigma", "flow_sigma_next", "flow_std", "flow_step")


def flow_matching_pair(x0: Tensor, noise: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """Rectified flow's regression pair (Note 7): the point x_σ = (1 − σ)·x_0 + σ·ε [N,D] between a
    demonstration x_0 [N,D] and noise ε [N,D] at noise level σ [N], and its velocity ε − x_0 [N,D]."""
    return (1 - sigma[:, None]) * x0 + sigma[:, None] * noise, noise - x0


def cfg_dropout(codes: Tensor, u: Tensor, p_uncond: float) -> Tensor:
    """Classifier-free guidance's condition dropout (Note 10): the discrete conditions ``codes`` [N,E]
    with every condition of row n set to the null value −1 where its uniform draw ``u`` [N] is below
    ``p_uncond`` (one draw per row: a row is fitted fully conditioned or fully unconditioned)."""
    return torch.where((u < p_uncond)[:, None], torch.full_like(codes, -1), codes)  # [N,E]


class VelocityMLP(nn.Module):
    """v_θ(x [N,D], σ [N], cond [N]) -> [N,D]: an MLP on x and Fourier features of σ, plus a label
    embedding (``cond`` int64 labels) or, with ``cond_dim``, a linear read of a condition vector
    (``cond`` [N,cond_dim] float: the prompt encoder's output, :class:`PromptEncoder`)."""

    def __init__(
        self,
        n_labels: int,
        hidden: int = 64,
        layers: int = 3,
        freqs: int = 4,
        cond_dim: int | None = None,
        dim: int = 2,
        code_sizes: Sequence[int] = (),
    ):
        super().__init__()
        if dim < 1 or any(n < 1 for n in code_sizes):
            raise ValueError(f"VelocityMLP needs dim >= 1 and code sizes >= 1; got {dim}, {list(code_sizes)}")
        if n_labels < 1 or hidden < 1 or layers < 2 or (cond_dim is not None and cond_dim < 1):
            raise ValueError(
                "VelocityMLP needs n_labels >= 1, hidden >= 1, layers >= 2, "
                f"cond_dim >= 1; got {n_labels}, {hidden}, {layers}, {cond_dim}"
            )
        self.n_labels = n_labels
        self.register_buffer("freqs", math.pi * torch.arange(1, freqs + 1, dtype=torch.float32))  # [F]
        self.inp = nn.Linear(dim + 1 + 2 * freqs, hidden)
        if cond_dim is None:
            self.label = nn.Embedding(n_labels, hidden)
        else:
            self.cond = nn.Linear(cond_dim, hidden, bias=False)
            # a condition of norm ~2.8 offsets each unit by ~1.4, like the label table's N(0, 1)
            nn.init.normal_(self.cond.weight, std=2.0 / math.sqrt(cond_dim))
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers - 2))
        self.out = nn.Linear(hidden, dim)
        # one table per discrete condition (a request extra, Note 8); its last row is the null condition (code -1)
        self.codes = nn.ModuleList(nn.Embedding(n + 1, hidden) for n in code_sizes)

    def forward(
        self, x: Tensor, sigma: Tensor, label: Tensor | None, extra: Tensor | None = None, codes: Tensor | None = None
    ) -> Tensor:
        """``label`` None: no label embedding; ``extra`` [N,H]: a further condition embedding added to it;
        ``codes`` [N,E] int64: the discrete conditions' values (-1 = null), one column per table."""
        x, sigma = x.to(self.freqs.dtype), sigma.to(self.freqs.dtype)  # the parameters' dtype
        f = sigma[:, None] * self.freqs  # [N,F]
        feats = torch.cat([x, sigma[:, None], torch.sin(f), torch.cos(f)], dim=-1)  # [N,D+1+2F]
        pre = self.inp(feats)  # [N,H]
        if label is not None:  # the label form's embedding row, or the embedding form's condition projected
            # [N,H]
            pre = pre + (self.label(label) if hasattr(self, "label") else self.cond(label.to(self.freqs.dtype)))
        if extra is not None:
            pre = pre + extra.to(pre.dtype)  # [N,H]
        for e, table in enumerate(self.codes):
            code = codes[:, e].long()  # [N]
            pre = pre + table(torch.where(code < 0, table.num_embeddings - 1, code))  # [N,H]
        h = nn.functional.silu(pre)  # [N,H]
        for layer in self.hidden:
            h = nn.functional.silu(layer(h))  # [N,H]
        return self.out(h)  # [N,D]


class FlowPolicy(NetPolicy):
    """Euler flow sampler over D-dim points (2 by default) conditioned on a label, an embedding or an
    observation (and discrete request conditions), SDE steps per ``sde`` (Flow-/Flash-GRPO)."""

    policy_file = "flow_policy.pt"  # what save writes and model.path loads (policy/kinds.py)

    def __init__(
        self,
        n_labels: int = 4,
        hidden: int = 64,
        layers: int = 3,
        steps: int = 10,
        sde: str = "one_shared",
        sde_window: int | None = None,
        shift: float = 1.0,
        init_seed: int = 0,
        condition: str = "label",
        embed_dim: int = 8,
        encoder_hidden: int = 32,
        cond_dim: int = 16,
        encoder_seed: int = 0,
        dim: int = 2,
        obs_dim: int = 0,
        condition_extras: dict[str, int] | None = None,
        sampler: str = "euler",
        noise: str = "flash",
        noise_level: float = 0.7,
        cfg_w: float = 0.0,
    ):
        if sde not in SDE_MODES:
            raise ValueError(f"FlowPolicy: sde must be one of {', '.join(SDE_MODES)}, got {sde!r}")
        if condition not in CONDITIONS:
            raise ValueError(f"FlowPolicy: condition must be one of {', '.join(CONDITIONS)}, got {condition!r}")
        window = steps // 2 if sde_window is None else sde_window
        if steps < 1 or not 1 <= window <= steps or shift <= 0:
            raise ValueError(
                f"FlowPolicy: need steps >= 1, 1 <= sde_window <= steps, shift > 0; got {steps}, {window}, {shift}"
            )
        if sampler not in SAMPLERS or noise not in NOISE_SCHEDULES or noise_level <= 0:
            raise ValueError(
                f"FlowPolicy: sampler must be one of {SAMPLERS} ({sampler!r}), noise one of {NOISE_SCHEDULES} "
                f"({noise!r}), noise_level > 0 ({noise_level})"
            )
        if sampler == "consistency" and not window <= steps - 1:
            raise ValueError(
                f"FlowPolicy: the consistency sampler's last step (to noise level 0) is deterministic and never "
                f"trained: need sde_window <= steps - 1 = {steps - 1}, got {window}"
            )
        if cfg_w and not condition_extras:
            raise ValueError(
                f"FlowPolicy: cfg_w = {cfg_w} guides toward a condition_extras condition (its null value is the "
                "unconditional velocity); set condition_extras, or cfg_w = 0"
            )
        extras = dict(condition_extras or {})
        if (
            dim < 1
            or (condition == "vector") != (obs_dim >= 1)
            or any(not isinstance(n, int) or n < 1 for n in extras.values())
        ):
            raise ValueError(
                f'FlowPolicy: need dim >= 1 ({dim}), obs_dim >= 1 exactly with condition = "vector" ({obs_dim}), and '
                f"condition_extras as {{name: number of values >= 1}} ({extras})"
            )
        self.config = {"n_labels": n_labels, "hidden": hidden, "layers": layers, "steps": steps, "shift": shift}
        if dim != 2:  # the 2-D toy's config (and so its checkpoints) stays as it was
            self.config["dim"] = dim
        if condition == "vector":
            self.config.update(condition=condition, obs_dim=obs_dim)
        if extras:
            self.config["condition_extras"] = extras
        self.dim, self.obs_dim, self.condition_extras = dim, obs_dim, extras
        if condition == "embedding":  # the label form's config (and so its checkpoints) stays as it was
            self.config.update(
                condition=condition,
                embed_dim=embed_dim,
                encoder_hidden=encoder_hidden,
                cond_dim=cond_dim,
                encoder_seed=encoder_seed,
            )
        self.condition = condition
        self.sde, self.window, self.steps, self.shift = sde, window, steps, shift
        self.sampler, self.noise, self.noise_level, self.cfg_w = sampler, noise, noise_level, float(cfg_w)
        self.sigmas = flow_sigmas(steps, shift)  # [K+1]
        self.sigma_max, self.sigma_min = float(self.sigmas[1]), float(self.sigmas[-1])
        with torch.random.fork_rng(devices=[]):  # seeded init that leaves the global stream alone
            torch.manual_seed(init_seed)
            self.net = VelocityMLP(
                n_labels,
                hidden,
                layers,
                cond_dim={"embedding": cond_dim, "vector": obs_dim}.get(condition),
                dim=dim,
                code_sizes=list(extras.values()),
            ).double()  # float64: see Note 3
        self.encoder: PromptEncoder | None = None
        if condition == "embedding":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(encoder_seed)
                self.encoder = PromptEncoder(n_labels, embed_dim, encoder_hidden, cond_dim).double()
        self.trainable = True
        self.modality = "flow"
        # the extras generate writes (Notes 2, 8): a component's reads_extras is checked against them at build
        self.row_extras = frozenset({"x_final"})
        self.token_extras = frozenset(TOKEN_EXTRAS) | ({"flow_cond"} if condition == "vector" or extras else set())
        # greedy = the deterministic sampler; sampler, steps, cfg_w: a greedy (evaluation) call's kernel (Note 9)
        self.request_options = frozenset({"greedy", "sampler", "steps", "cfg_w"})
        self.quantities = QUANTITIES  # what forward computes (the providers of these needs check it at build)
        # groupwise.hooks kinds generate applies
        self.hooks = frozenset({"embed_delta"}) if condition == "embedding" else frozenset()

        self.reference: FlowPolicy | None = None
        self.context = None  # no context length: a label is the whole prompt

    @property
    def T(self) -> int:
        return self._steps_trained(self.sde)

    def _steps_trained(self, sde: str, sampler: str | None = None, steps: int | None = None) -> int:
        """Trained steps per row: every step (``all``; the consistency kernel's last one excepted), none, or one."""
        steps = self.steps if steps is None else steps
        every = steps - 1 if (sampler or self.sampler) == "consistency" else steps
        return {"all": every, "none": 0}.get(sde, 1)

    def check_fits(self, ids: list[int], max_new_tokens: int, where: str) -> None:
        """Nothing to check: the sampler's length is ``steps``, not a token budget."""

    # ------------------------------------------------------------------ sampling
    def encode(self, prompt: Any) -> list:
        """A dataset prompt as the policy's encoded prompt: a label (or ``[label]``) as ``[label]``; the
        vector form's observation (``obs_dim`` numbers) as a list of floats (Note 8)."""
        if self.condition == "vector":
            try:
                obs = [float(v) for v in prompt]
            except (TypeError, ValueError):
                obs = []
            if len(obs) != self.obs_dim or not all(math.isfinite(v) for v in obs):
                raise ValueError(
                    f"FlowPolicy: a prompt must be an observation of {self.obs_dim} numbers, got {prompt!r}"
                )
            return obs
        label = prompt[0] if isinstance(prompt, (list, tuple)) and len(prompt) == 1 else prompt
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < self.net.n_labels:
            raise ValueError(f"FlowPolicy: a prompt must be a label in [0, {self.net.n_labels}), got {prompt!r}")
        return [label]

    def decode(self, rollout: Rollout) -> list[list[str]]:
        """[B][G] texts of the final samples, ``"x1,x2,…"`` ("" for padding rows), for logs and text rewards."""
        finals, valid = rollout.extras["x_final"].tolist(), rollout.group_valid.tolist()
        return [
            [",".join(f"{v:.4f}" for v in point) if ok else "" for point, ok in zip(row, oks)]
            for row, oks in zip(finals, valid)
        ]

    def _draws(
        self, requests: Sequence[Request], info: StepInfo, G: int, K: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x_1 [B,G,D], ε [B,G,K,D] and the SDE step index [B,G] of every row, from its own seed."""
        B, K, D = len(requests), self.steps if K is None else K, self.dim
        x1, eps, idx = torch.zeros(B, G, D), torch.zeros(B, G, K, D), torch.zeros(B, G, dtype=torch.long)
        for b, req in enumerate(requests):
            offset = getattr(req, "offset", 0)
            shared = torch.Generator().manual_seed(sample_seed(info.seed, info.step, req.key, -1 - offset))
            group_idx = torch.randint(self.window, (1,), generator=shared)
            for j in range(req.n):
                g = torch.Generator().manual_seed(sample_seed(info.seed, info.step, req.key, offset + j))
                x1[b, j], eps[b, j] = torch.randn(D, generator=g), torch.randn(K, D, generator=g)
                idx[b, j] = torch.randint(self.window, (1,), generator=g) if self.sde == "one_per_row" else group_idx
        return x1, eps, idx

    def original_condition(self, labels: Tensor) -> Tensor:
        """[N,cond_dim] float64: the embedding form's condition C^orig = f(tokens[label]) of each label [N]."""
        if self.encoder is None:
            raise ValueError(
                "FlowPolicy.original_condition: the label form has no "
                'condition vector (model.params.condition = "embedding")'
            )
        return self.encoder(self.encoder.tokens[labels])  # [N,c]

    def prompt_encoder(self) -> tuple[Tensor, Any]:
        """E²PO phase I's view of the embedding condition (``phases/e2po_perturb.prompt_space``):
        ``(tokens [n_labels,d], f)`` with ``f(emb [M,S,d], real [M,S]) -> [M,cond_dim]`` the frozen
        encoder of the sum of the real tokens' embeddings (a flow prompt is one token: S = 1)."""
        if self.encoder is None:
            raise ValueError(
                "the flow policy's label form has no prompt embedding "
                'to perturb; set model.params.condition = "embedding"'
            )
        encoder = self.encoder

        def encode(emb: Tensor, real: Tensor) -> Tensor:
            return encoder((emb.to(encoder.w1.dtype) * real[..., None]).sum(1))  # [M,c]

        return encoder.tokens, encode

    def _conditions(self, requests: Sequence[Request], labels: Tensor, G: int) -> tuple[Tensor | None, ...]:
        """The embedding form's per-row conditions of a call (``flow_condition.hooked_conditions``;
        None ×4 for the label form)."""
        if any(r.hook is not None for r in requests) and self.encoder is None:
            raise ValueError(
                "FlowPolicy.generate: a generation hook needs the embedding "
                'condition (model.params.condition = "embedding"); '
                "the label form applies no hooks"
            )
        return (
            (None, None, None, None) if self.encoder is None else hooked_conditions(self.encoder, requests, labels, G)
        )

    def _velocity(
        self, x: Tensor, sigma: Tensor, label: Tensor, cond: Tensor | None, codes: Tensor | None = None
    ) -> Tensor:
        """v_θ [N,D] of points x [N,D] at σ [N] for labels [N] (the embedding form: conditions [N,c]; the
        vector form: observations [N,obs_dim]); ``cond`` [N,...] a subclass's further condition (None
        here); ``codes`` [N,E] the discrete conditions (request extras, Note 8), None without them."""
        return self.net(x, sigma, label) if codes is None else self.net(x, sigma, label, None, codes)  # [N,D]

    def _guided(
        self, x: Tensor, sigma: Tensor, label: Tensor, cond: Tensor | None, codes: Tensor | None, w: float
    ) -> Tensor:
        """v [N,D]; with guidance w ≠ 0, v_u + w·(v_c − v_u), v_u under the null codes (Note 9)."""
        if not w:
            return self._velocity(x, sigma, label, cond, *(() if codes is None else (codes,)))  # [N,D]
        v_cond = self._velocity(x, sigma, label, cond, codes)  # [N,D]
        v_null = self._velocity(x, sigma, label, cond, torch.full_like(codes, -1))  # [N,D]
        return cfg_velocity(v_null, v_cond, w)  # [N,D]

    def _call_kernel(self, sampling: dict, greedy: bool) -> tuple[str, int, float]:
        """The sampler, number of steps and guidance of one call: the policy's own, or a greedy call's
        ``sampling`` overrides (``eval.sampling``: deploy a trained net with another sampler, Note 9)."""
        sampler = sampling.get("sampler", self.sampler)
        K = int(sampling.get("steps", self.steps))
        w = float(sampling.get("cfg_w", self.cfg_w))
        if sampler not in SAMPLERS or K < 2 - (sampler == "euler"):
            raise ValueError(
                f"FlowPolicy.generate: sampler {sampler!r} must be one of {SAMPLERS}, with steps >= 1 ({K})"
            )
        if w and not self.condition_extras:
            raise ValueError(f"FlowPolicy.generate: cfg_w = {w} needs condition_extras to guide toward")
        if not greedy and (sampler, K, w) != (self.sampler, self.steps, self.cfg_w):
            raise ValueError(
                f"FlowPolicy.generate: a sampled (trainable) call runs the policy's own kernel {self.sampler!r}, "
                f"{self.steps} steps, cfg_w {self.cfg_w} (what forward re-scores); got {sampler!r}, {K}, {w}. "
                "Overrides of sampler / steps / cfg_w are for greedy calls (evaluation)"
            )
        return sampler, K, w

    def _request_codes(self, requests: Sequence[Request], G: int) -> Tensor | None:
        """[B,G,E] int64: each row's value of every ``condition_extras`` name from its request's
        ``extras`` (-1, the null condition, where a request does not set it); None without any."""
        if not self.condition_extras:
            return None
        codes = torch.full((len(requests), G, len(self.condition_extras)), -1, dtype=torch.long)  # [B,G,E]
        for b, req in enumerate(requests):
            for e, (name, size) in enumerate(self.condition_extras.items()):
                if req.extras and name in req.extras:
                    value = torch.as_tensor(req.extras[name]).long().reshape(-1).expand(req.n)  # [n]
                    if bool(((value < -1) | (value >= size)).any()):
                        raise ValueError(
                            f"FlowPolicy.generate: request {b}'s condition {name!r} = {value.tolist()} must lie in "
                            f"-1..{size - 1} (-1: the null condition)"
                        )
                    codes[b, : req.n, e] = value
        return codes

    def _stored_condition(self, rollout: Rollout, sel: Tensor) -> Tensor | None:
        """The further condition of the selected trained steps ``sel`` [B,G,T] (None: the label is all)."""
        return None

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        return self._generate_flow(requests, sampling, info, None)

    def _generate_flow(
        self, requests: Sequence[Request], sampling: dict, info: StepInfo, cond: Tensor | None
    ) -> Rollout:
        """The rows of ``requests`` (``cond`` [B,G,...]: a further per-row condition for ``_velocity``, or None)."""
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("FlowPolicy.generate needs at least one request, each with n >= 1")
        prompts = [self.encode(r.prompt) for r in requests]
        vector = self.condition == "vector"
        if vector:  # observations [B,C], rounded to float32 as flow_cond stores them (Note 3)
            labels = torch.tensor(prompts, dtype=torch.float32).double()  # [B,C]
        else:
            labels = torch.tensor([p[0] for p in prompts])  # [B]
        greedy = bool(sampling.get("greedy"))
        sampler, K, w = self._call_kernel(sampling, greedy)
        sigmas = self.sigmas if K == self.steps else flow_sigmas(K, self.shift)  # [K+1]
        sigma_min, sigma_max = float(sigmas[-1]), float(sigmas[1])
        sde = "none" if greedy else self.sde  # evaluation: the deterministic sampler
        B, G, T, D = len(requests), max(r.n for r in requests), self._steps_trained(sde, sampler, K), self.dim
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        x1, eps, idx = self._draws(requests, info, G, K)  # [B,G,D], [B,G,K,D], [B,G]
        codes = self._request_codes(requests, G)  # [B,G,E] or None
        N = B * G
        x, lab, idx, eps = x1.view(N, D), labels.repeat_interleave(G, dim=0), idx.view(N), eps.view(N, K, D)
        codes = None if codes is None else codes.view(N, -1)  # [N,E]
        c_orig, c_pert, perturbed, rho = (
            self._conditions(requests, labels, G) if not vector else (None,) * 4
        )  # [N,c] / [N] (None: label and vector forms)
        rec = {k: torch.zeros(N, T, D) for k in ("flow_x", "flow_x_next")}
        rec.update({k: torch.zeros(N, T) for k in ("flow_sigma", "flow_sigma_next", "flow_std", "logp")})
        rec["flow_step"] = torch.zeros(N, T, dtype=torch.long)
        for i in range(K):
            s, sp = sigmas[i].expand(N), sigmas[i + 1].expand(N)  # [N], [N]
            c = (
                lab if c_orig is None else mixed_condition(c_orig, c_pert, perturbed, rho, float(sigmas[i]))
            )  # [N] labels, [N,c] or [N,C]
            further = None if cond is None else cond.reshape(N, *cond.shape[2:])
            v = self._guided(x, s, c, further, codes, w)  # [N,D]
            sde_rows = torch.full((N,), sde == "all") if sde in ("all", "none") else idx == i  # [N]
            if sampler == "consistency":  # every step is the kernel's own draw (ε = 0 when greedy)
                sde_rows = sde_rows & (i < K - 1)  # [N] its last step (to σ = 0) is deterministic, never trained
                x_next, logp, _, std, _ = consistency_step(v, x, s, sp, noise=eps[:, i] * (not greedy))
            else:
                x_next = (x.double() + v * (sp - s).double()[:, None]).float()  # [N,D] ODE step
            if sampler == "euler" and sde_rows.any():
                x_sde, logp, _, std, _, _ = sde_step_with_logprob(
                    v,
                    x,
                    s,
                    sp,
                    sigma_min,
                    sigma_max,
                    noise=eps[:, i],
                    schedule=self.noise,
                    noise_level=self.noise_level,
                )
                x_next = torch.where(sde_rows[:, None], x_sde, x_next)  # [N,D]
            if sde_rows.any():
                t = i if sde == "all" else 0
                r = sde_rows.nonzero()[:, 0]  # rows whose trained step is i
                for key, value in (
                    ("flow_x", x),
                    ("flow_x_next", x_next),
                    ("flow_sigma", s),
                    ("flow_sigma_next", sp),
                    ("flow_std", std),
                    ("logp", logp),
                ):
                    rec[key][r, t] = value[r]
                rec["flow_step"][r, t] = i
            x = x_next
        mask = valid[..., None].expand(B, G, T).clone()  # [B,G,T] every trained step of a real row
        finals = x.view(B, G, D)  # [B,G,D]
        out = Rollout(
            prompt_ids=[list(p) for p in prompts] if vector else [[int(label)] for label in labels],
            actions=torch.zeros(B, G, T, dtype=torch.long),  # [B,G,T] continuous actions live in the extras
            mask=mask,
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests], dtype=torch.long),
            meta=[{"prompt": list(p) if vector else int(p[0])} for p in prompts],
            logp_sampler=rec.pop("logp").view(B, G, T) * mask,  # [B,G,T]
        )
        for key, value in rec.items():
            value = value.view(B, G, T, *value.shape[2:])  # [B,G,T(,D)]
            out.set_extra(key, value * mask.view(B, G, T, *[1] * (value.dim() - 3)), "token")
        stored = self._step_conditions(labels if vector else None, codes, B, G)  # [B,G,C+E] or None
        if stored is not None:  # what each trained step was conditioned on (Note 8)
            out.set_extra("flow_cond", stored[:, :, None, :] * mask[..., None], "token")  # [B,G,T,C+E]
        out.set_extra("x_final", torch.where(valid[..., None], finals, torch.zeros(())), "row")  # [B,G,D]
        out.completions = self.decode(out)
        return out

    # ------------------------------------------------------------------ demonstrations (M1)
    def encode_target(self, row: dict) -> Tensor:
        """A demonstration row's ``target`` (a point of ``dim`` numbers) as a float64 tensor [D]; with
        ``condition_extras``, [D + E]: the point, then the row's value of each condition (its column of
        that name, an integer in -1..n−1; -1 or absent = the null condition), the conditions the
        demonstration was made under (Note 10)."""
        if "target" not in row:
            raise ValueError(
                "FlowPolicy.encode_target: a demonstration row needs a `target` column "
                f"(a point of {self.dim} numbers); got the columns {sorted(row)}"
            )
        target = torch.as_tensor(row["target"], dtype=torch.float64)  # [D]
        if target.shape != (self.dim,) or not bool(torch.isfinite(target).all()):
            raise ValueError(
                f"FlowPolicy.encode_target: `target` must be {self.dim} finite numbers, got {row['target']!r}"
            )
        if not self.condition_extras:
            return target
        codes = []
        for name, size in self.condition_extras.items():
            value = row.get(name, -1)
            if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < size:
                raise ValueError(
                    f"FlowPolicy.encode_target: a demonstration's condition {name!r} must be an integer in "
                    f"-1..{size - 1} (-1: the null condition), got {value!r}"
                )
            codes.append(float(value))
        return torch.cat([target, torch.tensor(codes, dtype=torch.float64)])  # [D+E]

    def supervised_loss(
        self, prompts: Sequence[list[int]], targets: Sequence[Tensor], gen: torch.Generator, p_uncond: float = 0.0
    ) -> Tensor:
        """The rectified-flow matching loss of demonstrations (a scalar with grad; Note 7):
        ``mean_{n,d} (v_θ(x_σ, σ, c_n) − (ε − x_0))²`` with x_σ = (1 − σ)·x_0 + σ·ε, σ ~ U(0, 1) and
        ε ~ N(0, I) drawn from ``gen`` (σ [N] then ε [N,D]), x_0 the target [D]. With
        ``condition_extras`` the velocity reads each row's conditions (``encode_target``'s last E
        numbers), each row's set replaced by the null one with probability ``p_uncond``
        (classifier-free guidance's condition dropout, Note 10: then u [N] ~ U(0, 1) is drawn last)."""
        if len(prompts) != len(targets) or not prompts:
            raise ValueError(
                "FlowPolicy.supervised_loss: need as many prompts as targets (>= 1), "
                f"got {len(prompts)} and {len(targets)}"
            )
        if not 0.0 <= p_uncond <= 1.0 or (p_uncond and not self.condition_extras):
            raise ValueError(
                f"FlowPolicy.supervised_loss: p_uncond = {p_uncond} must lie in [0, 1], and it drops the "
                "condition_extras conditions (classifier-free guidance): set model.params.condition_extras, "
                "or p_uncond = 0"
            )
        if self.condition == "vector":  # observations [N,C], rounded as sampling rounds them
            labels = torch.tensor([self.encode(p) for p in prompts], dtype=torch.float32).double()
        else:
            labels = torch.tensor([self.encode(p)[0] for p in prompts], dtype=torch.long)  # [N]
        rows = torch.stack([torch.as_tensor(t, dtype=torch.float64) for t in targets])  # [N,D(+E)]
        x0 = rows[:, : self.dim]  # [N,D]
        sigma = torch.rand(len(prompts), generator=gen, dtype=torch.float64)  # [N]
        noise = torch.randn(x0.shape, generator=gen, dtype=torch.float64)  # [N,D]
        x_sigma, velocity = flow_matching_pair(x0, noise, sigma)  # [N,D], [N,D]
        cond = labels if self.encoder is None else self.original_condition(labels)  # [N], [N,c] or [N,C]
        if not self.condition_extras:
            v = self._velocity(x_sigma, sigma, cond, None)  # [N,D]
        else:
            codes = rows[:, self.dim :].round().long()  # [N,E]
            if codes.shape[1] != len(self.condition_extras):
                raise ValueError(
                    f"FlowPolicy.supervised_loss: each target must hold the point and the {len(self.condition_extras)} "
                    f"condition values {list(self.condition_extras)} (encode_target), got {rows.shape[1]} numbers"
                )
            if p_uncond:  # drawn only when on, so a fit without dropout draws as before
                codes = cfg_dropout(codes, torch.rand(len(prompts), generator=gen, dtype=torch.float64), p_uncond)
            v = self._velocity(x_sigma, sigma, cond, None, codes)  # [N,D]
        return ((v - velocity) ** 2).mean()

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``{"logp": [B,G,T] float32}``: log-prob of each stored trained transition under the current net
        and the policy's kernel; on request ``"entropy"``: the Gaussian step's entropy per dimension,
        ½·log(2πe) + log(scale) (scale std_t·√−dt, or s for the consistency kernel; fixed by the
        schedule, logged like an LM's token entropy); ``"step_mean"`` [B,G,T,D]: the mean of that
        Gaussian step; ``"x0_pred"`` [B,G,T,D]: the clean-sample prediction x̂₀ = x − σ·v_θ (Note 9)."""
        unknown = [q for q in quantities if q not in QUANTITIES]
        if unknown:
            raise ValueError(f"FlowPolicy.forward computes {sorted(QUANTITIES)}, not {unknown}")
        missing = [k for k in TOKEN_EXTRAS if k not in rollout.extras]
        if missing:
            raise ValueError(f"FlowPolicy.forward needs the token extras {missing}, written by FlowPolicy.generate")
        sel = rollout.mask.bool()  # [B,G,T]
        x, x_next = rollout.extras["flow_x"][sel], rollout.extras["flow_x_next"][sel]  # [M,D], [M,D]
        s, sp = rollout.extras["flow_sigma"][sel], rollout.extras["flow_sigma_next"][sel]  # [M], [M]
        logp = torch.zeros(sel.shape)  # [B,G,T]
        shape = (*sel.shape, x.shape[-1])  # [B,G,T,D]
        mean, x0 = torch.zeros(shape), torch.zeros(shape)  # [B,G,T,D]
        if sel.any():
            cond, codes = self._step_condition(rollout, sel)  # [M] labels / [M,c] C^orig / [M,C]; [M,E] or None
            further = self._stored_condition(rollout, sel)
            v = self._guided(x, s, cond, further, codes, self.cfg_w)  # [M,D]
            if self.sampler == "consistency":
                _, logp[sel], mean[sel], _, x0[sel] = consistency_step(v, x, s, sp, prev_sample=x_next)
            else:
                _, logp[sel], mean[sel], *_ = sde_step_with_logprob(
                    v, x, s, sp, self.sigma_min, self.sigma_max, x_next, None, self.noise, self.noise_level
                )  # [M], [M,D]
                if "x0_pred" in quantities:
                    x0[sel] = (x.double() - s.double()[:, None] * v.double()).to(x.dtype)  # [M,D]
        out = {"logp": logp}
        if "step_mean" in quantities:
            out["step_mean"] = mean  # [B,G,T,D]
        if "x0_pred" in quantities:
            out["x0_pred"] = x0  # [B,G,T,D]
        if "entropy" in quantities:
            gap = (rollout.extras["flow_sigma"] - rollout.extras["flow_sigma_next"]).clamp(min=0)  # [B,G,T]
            scale = rollout.extras["flow_std"] * (
                torch.ones(()) if self.sampler == "consistency" else gap.sqrt()
            )  # [B,G,T]
            out["entropy"] = torch.where(
                sel, 0.5 * math.log(2 * math.pi * math.e) + scale.clamp(min=1e-30).log(), torch.zeros(())
            )  # [B,G,T]
        return out

    def _step_conditions(self, obs: Tensor | None, codes: Tensor | None, B: int, G: int) -> Tensor | None:
        """[B,G,C+E] float32 of a sampling call: each row's observation (vector form) then its discrete
        conditions, what ``flow_cond`` stores per trained step; None for the label and embedding forms
        without condition extras (their label is in the row's context)."""
        parts = []
        if obs is not None:
            parts.append(obs.float().repeat_interleave(G, dim=0).view(B, G, -1))  # [B,G,C]
        if codes is not None:
            parts.append(codes.float().view(B, G, -1))  # [B,G,E]
        return torch.cat(parts, dim=-1) if parts else None

    def _step_condition(self, rollout: Rollout, sel: Tensor) -> tuple[Tensor, Tensor | None]:
        """The condition of every selected trained step ``sel`` [B,G,T]: the vector form's stored
        observation [M,C] (``flow_cond``), else the label of the row's own context [M] (``ctx`` when a
        strategy set one, else its group's prompt), as the embedding form's C^orig [M,c] (never a
        hook's); with the discrete codes [M,E] stored in ``flow_cond`` (None without any)."""
        stored = rollout.extras.get("flow_cond")  # [B,G,T,C+E] or None
        if (self.condition == "vector" or self.condition_extras) and stored is None:
            raise ValueError(
                "FlowPolicy.forward: this policy reads the token extra 'flow_cond' (its stored conditions), "
                "written by FlowPolicy.generate"
            )
        codes = None if not self.condition_extras else stored[sel][:, self.obs_dim :].round().long()  # [M,E]
        if self.condition == "vector":
            return stored[sel][:, : self.obs_dim].double(), codes  # [M,C]
        lab = row_labels(rollout)[:, :, None].expand(sel.shape)[sel]  # [M]
        return (lab if self.encoder is None else self.original_condition(lab)), codes
