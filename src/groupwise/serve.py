"""``groupwise serve MODEL``: generation as a service, an OpenAI-compatible HTTP server over our engine.

The trainer (``rollout.backend = "server"``, ``rollout/remote.py``) and any OpenAI client talk to it
the way they would talk to ``vllm serve``: ``POST /v1/completions`` and ``/v1/chat/completions``
return the sampled token ids and each token's log-probability, as vLLM does with
``return_token_ids`` (vLLM's OpenAI-compatible server, ``vllm/entrypoints/openai/protocol.py``, read for
the field names; nothing copied). Generation runs through the policy's own ``CPUEngine``
(``policy/engine.py``), so a row's tokens depend only on its seed and the weights.

Endpoints

- ``GET /health`` — ``{"status": "ok", "version": v, "paused": bool}``; ``GET /v1/models``.
- ``POST /v1/completions`` — ``prompt``: a string, a list of strings, a list of token ids or a list
  of lists of token ids; ``n``, ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``top_k``
  (vLLM's extension; 0 or -1 = off), ``seed``, ``logprobs`` (0 or 1: the sampled token's),
  ``return_token_ids``. Extension: ``row_seeds`` (one int per returned choice: the trainer's own
  per-row seeds, so that a served rollout draws exactly what ``rollout.backend = "local"`` draws).
- ``POST /v1/chat/completions`` — ``messages`` (the tokenizer's chat template; a tokenizer without
  one gets the messages' contents joined by newlines), ``n``, ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs`` (bool),
  ``return_token_ids``, ``row_seeds``.
- ``POST /v1/load_weights`` — ``{"path": FOLDER | FILE, "version": int?}``: a model folder (its
  ``*.safetensors``), a ``.safetensors`` file or a torch state-dict file (``.pt``/``.bin``; put it on
  ``/dev/shm`` for a shared-memory hand-over); every tensor of the model must be there with its
  shape. The new version is the one given, else the old one + 1; the response carries it.
- ``POST /pause`` (waits for the generation in progress; later requests wait until) ``POST /resume``.

Determinism: row ``j`` of prompt ``b`` samples with ``sample_seed(seed, 0, b, j)`` (``seeds.py``), so
the same ``seed`` gives the same tokens whatever else is served; a request without a seed gets a
fresh random one. Every response carries ``policy_version``: the weights it was sampled under.

Errors: a bad request gets a 400 (OpenAI's error body: ``{"error": {"message", "type", "code"}}``)
naming the field and what is allowed; an exception inside one request is a 500 for that request
only. Requests are served one generation at a time (one model, one engine).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from groupwise.seeds import sample_seed

MAX_N = 1024  # choices per prompt
MAX_PROMPTS = 4096  # prompts per request


class BadRequest(ValueError):
    """A request the server refuses: a 400 naming the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields we do not use (user, presence_penalty at 0...) pass

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stream: bool = False
    stop: str | list[str] | None = None
    return_token_ids: bool = False
    row_seeds: list[int] | None = None  # groupwise's extension: one seed per returned choice


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)


class LoadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    version: int | None = Field(None, ge=0)


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors at ``path``: a model folder's ``*.safetensors``, one ``.safetensors`` file, or a
    torch state-dict file (``torch.save``; loaded with ``weights_only``)."""
    from safetensors.torch import load_file

    where = Path(path)
    if where.is_dir():
        files = sorted(where.glob("*.safetensors"))
        if not files:
            raise BadRequest(f"load_weights: folder {path!r} has no *.safetensors file", "path")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    if not where.is_file():
        raise BadRequest(f"load_weights: {path!r} is neither a model folder nor a state-dict file", "path")
    if where.suffix == ".safetensors":
        return load_file(str(where))
    try:
        state = torch.load(str(where), map_location="cpu", weights_only=True)
    except Exception as err:  # not a torch file: say which file and what was expected
        raise BadRequest(
            f"load_weights: {path!r} is not a .safetensors or torch state-dict file ({type(err).__name__})", "path"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BadRequest(f"load_weights: {path!r} does not hold a dict of tensors", "path")
    return state


class GenerationServer:
    """The served policy (an ``LMPolicy``), its weights' version, and the pause gate. Thread-safe:
    one generation or weight load at a time."""

    def __init__(self, policy: Any, name: str = "default", version: int = 0):
        self.policy, self.name, self.version = policy, name, version
        self._lock = threading.Lock()  # the model: one generation or weight load at a time
        self._gate = threading.Condition()  # pause/resume
        self.paused = False
        self.served = 0  # requests answered with a generation

    # ------------------------------------------------------------------ control
    def pause(self) -> None:
        with self._gate:
            self.paused = True
        with self._lock:  # the generation in progress finishes before pause returns
            pass

    def resume(self) -> None:
        with self._gate:
            self.paused = False
            self._gate.notify_all()

    def load_weights(self, path: str, version: int | None = None) -> int:
        state = read_state_dict(path)
        module = self.policy.module
        own = module.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise BadRequest(
                f"load_weights: {path!r} does not match the served model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]} ({len(missing)} and {len(unexpected)} in all)",
                "path",
            )
        wrong = [k for k in own if own[k].shape != state[k].shape]
        if wrong:
            raise BadRequest(
                f"load_weights: {path!r}: {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the served model's is "
                f"{tuple(own[wrong[0]].shape)}",
                "path",
            )
        with self._lock, torch.no_grad():
            module.load_state_dict(state)
            self.version = self.version + 1 if version is None else int(version)
            return self.version

    # ------------------------------------------------------------------ generation
    def _encode_text(self, text: str) -> list[int]:
        return list(self.policy.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """[P][L] token ids of a completion request's ``prompt``."""
        if isinstance(prompt, str):
            prompts = [self._encode_text(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [self._encode_text(p) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        return prompts

    def _check(self, prompts: list[list[int]], req: _Sampling, max_tokens: int, choices: int) -> None:
        vocab = self.policy.module.get_input_embeddings().weight.shape[0]
        context = self.policy.context
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise BadRequest(f"prompt: between 1 and {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
        for i, ids in enumerate(prompts):
            if not ids:
                raise BadRequest(f"prompt {i} is empty: every prompt needs at least one token", "prompt")
            if any(t < 0 or t >= vocab for t in ids):
                raise BadRequest(f"prompt {i} has token ids outside the vocabulary [0, {vocab})", "prompt")
            if context and len(ids) + max_tokens > context:
                raise BadRequest(
                    f"prompt {i}: {len(ids)} tokens + max_tokens={max_tokens} exceed the model's context of {context}; "
                    f"lower max_tokens",
                    "max_tokens",
                )
        if req.stream:
            raise BadRequest("stream=true is not supported by groupwise serve; send stream=false", "stream")
        if req.stop:
            raise BadRequest("stop strings are not supported (generation ends at EOS or max_tokens)", "stop")
        if req.row_seeds is not None:
            if len(req.row_seeds) != choices:
                raise BadRequest(
                    f"row_seeds: one seed per choice (prompts x n = {choices}), got {len(req.row_seeds)}", "row_seeds"
                )
            if any(s < 0 or s >= 1 << 63 for s in req.row_seeds):
                raise BadRequest("row_seeds must be in [0, 2**63)", "row_seeds")

    def generate(self, prompts: list[list[int]], req: _Sampling, max_tokens: int | None) -> dict[str, Any]:
        """Sample ``req.n`` completions of each prompt; the raw rows and the version they were sampled under."""
        if max_tokens is None:  # OpenAI's default of 16, within the context
            context = self.policy.context
            longest = max((len(p) for p in prompts), default=0)
            max_tokens = max(1, min(16, context - longest)) if context else 16
        choices = len(prompts) * req.n
        self._check(prompts, req, max_tokens, choices)
        if req.row_seeds is not None:
            seeds = list(req.row_seeds)
        else:
            seed = req.seed if req.seed is not None else secrets.randbits(62)
            seeds = [sample_seed(seed, 0, b, j) for b in range(len(prompts)) for j in range(req.n)]
        with self._gate:
            while self.paused:
                self._gate.wait()
        with self._lock:
            out = self.policy.engine.generate(
                prompts,
                req.n,
                torch.tensor(seeds, dtype=torch.long),
                max_tokens,
                temperature=req.temperature if req.temperature > 0 else 1.0,
                top_p=req.top_p,
                top_k=max(0, req.top_k),
                greedy=req.temperature == 0,
            )
            version = self.version
            self.served += 1
        eos = set(self.policy.eos)
        rows = []
        for b in range(len(prompts)):
            for j in range(req.n):
                length = int(out.lengths[b, j])
                ids = out.tokens[b, j, :length].tolist()
                rows.append(
                    {
                        "prompt": b,
                        "token_ids": ids,
                        "logprobs": out.logp[b, j, :length].tolist(),
                        "text": self.policy.tokenizer.decode(
                            [t for t in ids if t not in eos], skip_special_tokens=True
                        ),
                        "finish_reason": "length" if bool(out.truncated[b, j]) else "stop",
                    }
                )
        return {"rows": rows, "version": version, "prompts": prompts}

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.policy.tokenizer.decode([t]) for t in ids]

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        from groupwise.policy.lm import encode_prompt

        if getattr(self.policy.tokenizer, "chat_template", None):
            return encode_prompt(self.policy.tokenizer, [m.model_dump() for m in messages])
        return self._encode_text("\n".join(m.content for m in messages))


def _error(status: int, message: str, param: str | None = None):
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def create_app(server: GenerationServer):
    """The FastAPI application over ``server``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    app = FastAPI(title="groupwise serve")

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, err: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in err.errors()[:5]
        )
        return _error(400, f"invalid request: {problems}")

    @app.exception_handler(BadRequest)
    async def bad(_request: Request, err: BadRequest):
        return _error(400, str(err), err.param)

    @app.exception_handler(HTTPException)
    async def http(_request: Request, err: HTTPException):
        return _error(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def crashed(_request: Request, err: Exception):  # one request failed; the server goes on
        return _error(500, f"{type(err).__name__}: {err}")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "version": server.version, "paused": server.paused}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": server.name, "object": "model", "owned_by": "groupwise"}]}

    @app.post("/pause")
    def pause() -> dict:
        server.pause()
        return {"paused": True, "version": server.version}

    @app.post("/resume")
    def resume() -> dict:
        server.resume()
        return {"paused": False, "version": server.version}

    @app.post("/v1/load_weights")
    def load_weights(req: LoadWeightsRequest) -> dict:
        return {"version": server.load_weights(req.path, req.version)}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict:
        if req.echo:
            raise BadRequest("echo=true is not supported; send echo=false", "echo")
        if req.logprobs is not None and req.logprobs > 1:
            raise BadRequest("logprobs: 0 or 1 (the sampled token's log-probability); top alternatives are not served")
        gen = server.generate(server._prompts(req.prompt), req, req.max_tokens)
        choices = []
        for i, row in enumerate(gen["rows"]):
            choice: dict[str, Any] = {"index": i, "text": row["text"], "finish_reason": row["finish_reason"]}
            if req.logprobs is not None:
                texts = server.token_texts(row["token_ids"])
                offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
                choice["logprobs"] = {
                    "tokens": texts,
                    "token_logprobs": row["logprobs"],
                    "top_logprobs": [{t: lp} for t, lp in zip(texts, row["logprobs"])],
                    "text_offset": offsets,
                }
            else:
                choice["logprobs"] = None
            if req.return_token_ids:
                choice["token_ids"] = row["token_ids"]
                choice["prompt_token_ids"] = gen["prompts"][row["prompt"]]
            choices.append(choice)
        return _envelope("text_completion", server, gen, choices)

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest) -> dict:
        prompt = server.chat_prompt(req.messages)
        gen = server.generate([prompt], req, req.max_completion_tokens or req.max_tokens)
        choices = []
        for i, row in enumerate(gen["rows"]):
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": row["text"]},
                "finish_reason": row["finish_reason"],
                "logprobs": None,
            }
            if req.logprobs:
                choice["logprobs"] = {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(server.token_texts(row["token_ids"]), row["logprobs"])
                    ]
                }
            if req.return_token_ids:
                choice["token_ids"] = row["token_ids"]
            choices.append(choice)
        out = _envelope("chat.completion", server, gen, choices)
        if req.return_token_ids:
            out["prompt_token_ids"] = prompt
        return out

    return app


def _envelope(kind: str, server: GenerationServer, gen: dict, choices: list[dict]) -> dict:
    prompt_tokens = sum(len(p) for p in gen["prompts"])
    completion_tokens = sum(len(r["token_ids"]) for r in gen["rows"])
    return {
        "id": f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": server.name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "policy_version": gen["version"],
    }


# --------------------------------------------------------------------------- running it
def build_server(model: str = "default", overrides: list[str] = ()) -> GenerationServer:
    """The served policy: ``model.*`` / ``perf.*`` / ``threads`` overrides as ``groupwise train`` takes them."""
    from groupwise.config import load_config, toml_value
    from groupwise.policy.lm import LMPolicy

    cfg, _ = load_config(None, [f"model.path={toml_value(model)}", *overrides])
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    policy = LMPolicy(cfg.model, cfg.perf)
    policy.module.eval()
    return GenerationServer(policy, name=model)


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (port 0: a free port, read back with ``getsockname``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


class Running:
    """A server running in a thread of this process (tests, notebooks): ``url``, ``stop()``."""

    def __init__(self, server: GenerationServer, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server, self.sock = server, bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(server), log_level="warning", lifespan="off")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._uvicorn.started and self._thread.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        if not self._uvicorn.started:
            raise RuntimeError("groupwise serve: the server thread did not start within 30 s")

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
        self.sock.close()


def _exit_with(parent: int) -> None:
    import os

    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


SERVE_HELP = """usage: groupwise serve [MODEL] [--host H] [--port P] [--port-file FILE] [--parent-pid PID] [k=v ...]

Serve MODEL ("default", a shipped model's name or a model folder) over HTTP, OpenAI-compatible:
/v1/completions, /v1/chat/completions (token ids and per-token log-probs with return_token_ids),
/v1/load_weights, /pause, /resume, /health. key=value sets model.* / perf.* / threads as for
`groupwise train`. --port 0 (the default) takes a free port; the URL is printed and, with
--port-file, written to FILE. --parent-pid: exit when that process (the run that started it) is gone."""


def main(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(SERVE_HELP)
        return 0
    import uvicorn

    from groupwise.errors import ConfigError

    host, port, port_file, parent, rest = "127.0.0.1", 0, None, None, []
    items = iter(args)
    for item in items:
        if item in ("--host", "--port", "--port-file", "--parent-pid"):
            value = next(items, None)
            if value is None:
                raise ConfigError(f"{item} needs a value")
            if item == "--host":
                host = value
            elif item == "--port":
                port = int(value)
            elif item == "--parent-pid":
                parent = int(value)
            else:
                port_file = value
        else:
            rest.append(item)
    model = rest.pop(0) if rest and "=" not in rest[0] else "default"
    server = build_server(model, rest)
    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    print(f"groupwise serve: {model} on {url}", flush=True)
    if port_file:
        Path(port_file).write_text(url)
    if parent is not None:  # a server a training run started ends with it, even when the run is SIGKILLed
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning", lifespan="off")).run(sockets=[sock])
    return 0
