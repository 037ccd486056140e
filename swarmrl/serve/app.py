"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

What is supported, and how it differs from OpenAI's API (docs/eval.md has the table):
- ``max_tokens`` (``max_completion_tokens`` for chat too), ``temperature`` (0 is greedy),
  ``seed``, ``n``, ``stop`` (up to 4 strings), ``stream`` (server-sent events, with
  ``stream_options.include_usage``), ``logprobs`` (completions: an int 0-20; chat: a bool with
  ``top_logprobs`` 0-20). Logprobs are under the *sampling* distribution, softmax(logits / T)
  (raw logits at temperature 0), which is what the trainer uses.
- ``seed`` makes a request reproducible: completion j is sampled with seed ``seed + j``
  whatever else is in its batch. Without one, a random seed is drawn.
- vLLM's extensions for RL workers (completions): ``prompt`` as token ids,
  ``return_tokens_as_token_ids`` (logprob tokens spelled ``"token_id:ID"``) and
  ``return_token_ids`` (each choice's ``token_ids`` and ``prompt_token_ids``), so an endpoint
  worker reads exact token ids from this server as from vLLM (docs/engines.md).
- ``POST /v1/reload`` (only with ``--reload-token-file``, bearer token): load another checkpoint
  folder in place of the served one. Requests already queued finish on the old weights; the
  ones that arrive after the answer run on the new ones. The endpoint worker calls it for each
  new policy version.
- ``top_p`` other than 1, ``top_k`` other than -1/0, penalties other than 0, ``logit_bias``, ``echo``, ``suffix``,
  ``best_of`` > n, tools, and ``logprobs`` together with ``stream`` are refused with a 400
  naming the parameter, never silently ignored. Unknown fields are refused the same way.
- Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx
  status: a request is validated and measured (body size, prompt + max_tokens against the
  model's context, n) before anything runs.
- Completions queued or generating are capped per client address and in all (429 with
  ``Retry-After``, `limits.Queued`); a request whose client disconnects is dropped, or stopped at
  the next token step; (de)tokenising runs on a thread pool, off the event loop (docs/security.md).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from swarmrl.protocol.messages import BodyError, loads
from swarmrl.serve.engine import Choice, Engine, GenRequest
from swarmrl.serve.limits import ClientGone, OpenAIError, Queued, client_gone, error_handlers
from swarmrl.serve.requests import MAX_STOP, ChatRequest, CompletionRequest, TokenizeRequest, describe
from swarmrl.transport.connlimit import source_of


class Settings:
    """Limits of one server (the `swarmrl serve` flags)."""

    def __init__(
        self,
        *,
        model_name: str,
        context: int,
        max_n: int = 16,
        max_request_bytes: int = 1 << 20,
        default_max_tokens: int = 256,
        vocab_size: int | None = None,
        model_path: str | None = None,
        body_timeout_s: float = 30.0,
        max_queued_per_client: int = 256,
        max_queued_total: int = 1024,
        tokenizer_threads: int = 2,
    ):
        self.model_name, self.context, self.max_n = model_name, context, max_n
        self.body_timeout_s = body_timeout_s
        # Completions queued or generating: one client address's, and everyone's (`Queued`).
        self.max_queued_per_client, self.max_queued_total = max_queued_per_client, max_queued_total
        self.tokenizer_threads = tokenizer_threads
        self.max_request_bytes, self.default_max_tokens = max_request_bytes, default_max_tokens
        self.vocab_size, self.model_path = vocab_size, model_path


def trained_prompt_format(model_path: str | None) -> dict | None:
    """What prompts the served model was trained on, when it is one of this project's policies:
    read from the `swarmrl_sft.json` its base was written with (in the folder itself, or in the
    run's `v000000` beside it). A 1M-parameter model answers only prompts of its training form:
    anything else gets nonsense, so /v1/models and the start-up line say which form that is.
    None for any other checkpoint."""
    if not model_path:
        return None
    folder = Path(model_path)
    for meta_file in (folder / "swarmrl_sft.json", folder.parent / "v000000" / "swarmrl_sft.json"):
        if meta_file.is_file():
            break
    else:
        return None
    try:
        meta = json.loads(meta_file.read_text())
        digits, ops = int(meta["digits"]), str(meta["ops"])
    except (ValueError, KeyError, TypeError):
        return None
    from swarmrl.rewards.length import LENGTH_SUFFIX
    from swarmrl.tasks.arithmetic import Problem, prompt_for

    a, b = (10**digits - 1) * 7 // 9, (10**digits - 1) * 2 // 9  # e.g. 77 and 22, or 7 and 2
    example = prompt_for(Problem(a, b, ops[0]))
    targets = meta.get("length_targets")
    if targets:
        example += LENGTH_SUFFIX.format(N=targets[0])
    return {
        "task": f"{digits}-digit arithmetic ({' and '.join(ops)})",
        "example": example,
        "length_targets": targets,
        "how": "send the prompt as the user message of /v1/chat/completions (the chat template the "
        "model was trained with); /v1/completions takes the templated text",
    }


class Reloader:
    """What `POST /v1/reload` needs: `load(folder)` returns (a started Engine, the model's
    context, its vocabulary size) and may take long (it runs off the event loop); `token` is the
    bearer token a caller must send."""

    def __init__(self, load: Callable[[str], tuple[Engine, int, int]], token: str):
        if not token:
            raise ValueError("the reload token is empty: write a secret into the --reload-token-file")
        self.load, self.token = load, token


class _Routes:
    """The request handling of one server: parsing and checking a request against the server's
    limits, running it on the engine, and shaping OpenAI's reply (plain or streamed)."""

    def __init__(self, engine: Engine, settings: Settings, reloader: Reloader | None = None):
        self.engine, self.settings, self.tokenizer = engine, settings, engine.tokenizer
        self.reloader = reloader
        self.reloading = asyncio.Lock()
        self.queued = Queued(settings.max_queued_per_client, settings.max_queued_total)
        # Tokenising a 1 MB prompt takes seconds of CPU: on the event loop it held every other
        # client's requests, /health included. A small pool keeps the loop free; the fast
        # tokenizer releases the GIL while it encodes, and is only read, never reconfigured, here.
        self.text_pool = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="swarmrl-tokenize")
        # One address may use all but one of the pool's threads (at least one), so that another
        # address's prompt never queues behind a flood of megabyte prompts: [gate, users].
        self.per_source_threads = max(1, settings.tokenizer_threads - 1)
        self.text_gates: dict[str, list] = {}

    async def off_loop(self, http: Request, fn: Callable, *args):
        """fn(*args) on the tokenizer pool (tokenising, detokenising, shaping a long reply), at most
        `per_source_threads` at a time for the client's address; the others wait on the loop."""
        source = source_of(http.client.host if http.client else None)
        gate = self.text_gates.setdefault(source, [asyncio.Semaphore(self.per_source_threads), 0])
        gate[1] += 1
        try:
            async with gate[0]:
                return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)
        finally:
            gate[1] -= 1
            if not gate[1]:
                del self.text_gates[source]

    async def read_body(self, request: Request, model):
        """The request parsed into `model` (CompletionRequest or ChatRequest), after the body's size
        and JSON are checked; then the checks that depend on this server."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.settings.max_request_bytes:
            raise OpenAIError(
                413,
                f"request body of {length} bytes is over the limit of {self.settings.max_request_bytes} bytes",
                kind="invalid_request_error",
            )
        raw = b""
        try:  # a body trickled in must not hold a connection (and an engine slot's parse) for ever
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > self.settings.max_request_bytes:
                        raise OpenAIError(
                            413, f"request body is over the limit of {self.settings.max_request_bytes} bytes"
                        )
        except TimeoutError:
            raise OpenAIError(
                408, f"the request body did not arrive within {self.settings.body_timeout_s:g} s; send it at once"
            ) from None
        try:  # bad JSON, bad UTF-8, integers of thousands of digits, a key sent twice (docs/protocol.md)
            body = loads(raw)
        except BodyError as exc:
            raise OpenAIError(400, f"request body: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            message, param = describe(exc, body)
            raise OpenAIError(400, message, param) from None
        if isinstance(req, TokenizeRequest):
            if req.model not in (None, self.settings.model_name):
                raise OpenAIError(
                    404,
                    f"the model {req.model!r} does not exist; this server serves "
                    f"{self.settings.model_name!r} (GET /v1/models)",
                    "model",
                    "not_found_error",
                    "model_not_found",
                )
            return req
        if req.model != self.settings.model_name:
            raise OpenAIError(
                404,
                f"the model {req.model!r} does not exist; this server serves "
                f"{self.settings.model_name!r} (GET /v1/models)",
                "model",
                "not_found_error",
                "model_not_found",
            )
        for name, neutral in (
            ("top_p", (1,)),
            ("top_k", (-1, 0)),
            ("frequency_penalty", (0,)),
            ("presence_penalty", (0,)),
        ):
            if getattr(req, name) not in (None, *neutral):
                raise OpenAIError(
                    400,
                    f"'{name}' is not supported (only {' or '.join(map(str, neutral))}); sampling "
                    "here is plain temperature sampling, which validators replay",
                    name,
                )
        if req.logit_bias:
            raise OpenAIError(400, "'logit_bias' is not supported", "logit_bias")
        return req

    def gen_request(self, req, prompt_ids: list[int], *, top_logprobs: int) -> GenRequest:
        chat = isinstance(req, ChatRequest)
        if not prompt_ids:
            raise OpenAIError(400, "the prompt is empty", "prompt")
        room = self.settings.context - len(prompt_ids)
        if room < 1:
            raise OpenAIError(
                400,
                f"the prompt is {len(prompt_ids)} tokens; this model's context is {self.settings.context} tokens",
                "messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens if name == "max_completion_tokens" else req.max_tokens
        max_tokens = asked if asked is not None else min(self.settings.default_max_tokens if chat else 16, room)
        if len(prompt_ids) + max_tokens > self.settings.context:
            raise OpenAIError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + {name} ({max_tokens}) is over this "
                f"model's context of {self.settings.context} tokens; lower {name}",
                name,
                code="context_length_exceeded",
            )
        n = 1 if req.n is None else req.n
        if n > self.settings.max_n:
            raise OpenAIError(400, f"'n' must be an integer between 1 and {self.settings.max_n}, got {n}", "n")
        if req.best_of is not None and req.best_of != n:
            raise OpenAIError(400, "'best_of' other than n is not supported", "best_of")
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        seed = secrets.randbelow(1 << 62) if req.seed is None else req.seed
        if seed + n - 1 >= 1 << 63:  # completion j uses seed + j, a signed 64-bit integer
            raise OpenAIError(
                400,
                f"'seed' + n - 1 must be below 2**63 (completion j is sampled with seed + j); "
                f"got seed {seed} with n {n}",
                "seed",
            )
        stop = req.stops()
        if not all(stop):
            raise OpenAIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP}", "stop")
        if req.stream and top_logprobs >= 0:
            raise OpenAIError(400, "'logprobs' with 'stream' is not supported; ask without streaming", "logprobs")
        return GenRequest(prompt_ids, [seed + j for j in range(n)], max_tokens, temperature, stop, max(top_logprobs, 0))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, request: GenRequest, choices: list[Choice]) -> dict:
        completion = sum(len(c.token_ids) for c in choices)
        prompt = len(request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def run(self, http: Request, request: GenRequest) -> list[Choice]:
        """The request's choices; if its client disconnects first, the request is cancelled (dropped
        if it has not started, stopped at the next token step if it has) and ClientGone raised."""
        self.queued.admit(http, request)
        answer = asyncio.wrap_future(self.engine.submit(request))
        gone = asyncio.ensure_future(client_gone(http))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():
            request.cancel()
            answer.cancel()
            raise ClientGone()
        return answer.result()

    def stream(self, http: Request, request: GenRequest, make_chunk, finish_chunk, include_usage: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_delta(index: int, text: str | None, _tok: int | None) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(events.put_nowait, (index, text))

        request.on_delta = on_delta
        self.queued.admit(http, request)
        future = self.engine.submit(request)

        async def watch() -> None:
            await client_gone(http)
            request.cancel()
            events.put_nowait((-1, None))  # wake the body, which then ends

        async def body():
            # The request is cancelled however the body ends early: the client's disconnect seen
            # by `watch` (or by the server, which then stops iterating the body), or a failed send.
            watcher = asyncio.ensure_future(watch())
            try:
                for chunk in make_chunk(None):
                    yield f"data: {json.dumps(chunk)}\n\n"
                open_choices = request.n
                while open_choices:
                    index, text = await events.get()
                    if request.cancelled:
                        return
                    if text is None:
                        open_choices -= 1
                        continue
                    for chunk in make_chunk((index, text)):
                        yield f"data: {json.dumps(chunk)}\n\n"
            except BaseException:
                request.cancel()
                raise
            finally:
                watcher.cancel()
            try:
                choices = await asyncio.wrap_future(future)
            except Exception as exc:  # noqa: BLE001 - the batch failed: end the stream with an error
                error = {
                    "error": {
                        "message": f"generation failed: {type(exc).__name__}",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
                yield f"data: {json.dumps(error)}\n\n"
                yield "data: [DONE]\n\n"
                return
            for index, choice in enumerate(choices):
                yield f"data: {json.dumps(finish_chunk(index, choice))}\n\n"
            if include_usage:
                yield f"data: {json.dumps({**finish_chunk(None, None), 'choices': [], 'usage': self.usage(request, choices)})}\n\n"  # noqa: E501
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def prompt_ids(self, prompt) -> list[int]:
        """The token ids of a completion request's prompt: a string is tokenized, token ids
        (vLLM's extension) are checked against the vocabulary and used as they are."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not all(isinstance(t, int) for t in prompt):
            raise OpenAIError(400, "'prompt' must be a string or a list of token ids (one per request)", "prompt")
        vocab = self.settings.vocab_size or len(self.tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"'prompt' has token id {bad}; this model's ids are 0..{vocab - 1}", "prompt")
        return list(prompt)

    async def completions(self, request: Request):
        req = await self.read_body(request, CompletionRequest)
        if req.echo:
            raise OpenAIError(400, "'echo' is not supported", "echo")
        if req.suffix:
            raise OpenAIError(400, "'suffix' is not supported", "suffix")
        if req.stream and req.return_token_ids:
            raise OpenAIError(
                400,
                "'return_token_ids' together with 'stream' is not supported; ask without streaming",
                "return_token_ids",
            )
        top = req.logprobs
        ids = await self.off_loop(request, self.prompt_ids, req.prompt)
        gen = self.gen_request(req, ids, top_logprobs=-1 if top is None else top)
        cid, model = f"cmpl-{secrets.token_hex(12)}", self.settings.model_name
        # vLLM's spelling of a token that must be read back exactly: its id, not its text.
        spell = (lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids else self.token_text

        def logprobs_of(choice: Choice) -> dict | None:
            if top is None:
                return None
            texts = [self.token_text(t) for t in choice.token_ids]
            offsets, at = [], 0
            for text in texts:
                offsets.append(at)
                at += len(text)
            tops = None
            if top > 0:
                tops = [{spell(t): lp for t, lp in entry} for entry in choice.top_logprobs]
            return {
                "tokens": [spell(t) for t in choice.token_ids],
                "token_logprobs": choice.logprobs,
                "top_logprobs": tops,
                "text_offset": offsets,
            }

        def ids_of(choice: Choice) -> dict:
            if not req.return_token_ids:
                return {}
            return {"token_ids": list(choice.token_ids), "prompt_token_ids": ids}

        def base(choices: list) -> dict:
            return {
                "id": cid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
            }

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return self.stream(
                request,
                gen,
                lambda ev: (
                    []
                    if ev is None
                    else [base([{"index": ev[0], "text": ev[1], "logprobs": None, "finish_reason": None}])]
                ),
                lambda i, c: base(
                    [] if c is None else [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]
                ),
                include,
            )
        choices = await self.run(request, gen)

        # Detokenising every logprob token and encoding the JSON take long for n = 16 with
        # logprobs: both off the event loop (a JSONResponse is encoded when it is made).
        def reply() -> JSONResponse:
            return JSONResponse(
                {
                    **base(
                        [
                            {
                                "index": i,
                                "text": c.text,
                                "logprobs": logprobs_of(c),
                                "finish_reason": c.finish_reason,
                                **ids_of(c),
                            }
                            for i, c in enumerate(choices)
                        ]
                    ),
                    "usage": self.usage(gen, choices),
                }
            )

        return await self.off_loop(request, reply)

    async def tokenize(self, request: Request):
        req = await self.read_body(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")

        def tokens() -> list[int]:
            if req.messages is not None:
                text = self.tokenizer.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in req.messages],
                    tokenize=False,
                    add_generation_prompt=req.add_generation_prompt,
                )
            else:
                text = req.prompt
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

        def reply() -> JSONResponse:  # a million ids take a second to encode: off the loop too
            ids = tokens()
            return JSONResponse({"count": len(ids), "max_model_len": self.settings.context, "tokens": ids})

        return await self.off_loop(request, reply)

    async def chat(self, request: Request):
        req = await self.read_body(request, ChatRequest)
        logprobs, top = req.logprobs, req.top_logprobs
        if top is not None and not logprobs:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")

        def tokens() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in req.messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

        ids = await self.off_loop(request, tokens)
        gen = self.gen_request(req, ids, top_logprobs=(top or 0) if logprobs else -1)
        cid, model = f"chatcmpl-{secrets.token_hex(12)}", self.settings.model_name

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        def logprobs_of(choice: Choice) -> dict | None:
            if not logprobs:
                return None
            content = []
            for j, (t, lp) in enumerate(zip(choice.token_ids, choice.logprobs)):
                tops = [entry(a, b) for a, b in choice.top_logprobs[j]] if top else []
                content.append({**entry(t, lp), "top_logprobs": tops})
            return {"content": content}

        def base(choices: list, kind: str = "chat.completion") -> dict:
            return {"id": cid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)

            def make_chunk(ev):
                if ev is None:  # the opening chunk of every choice names the role
                    return [
                        base(
                            [
                                {
                                    "index": j,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            "chat.completion.chunk",
                        )
                        for j in range(gen.n)
                    ]
                return [
                    base(
                        [{"index": ev[0], "delta": {"content": ev[1]}, "logprobs": None, "finish_reason": None}],
                        "chat.completion.chunk",
                    )
                ]

            def finish_chunk(i, c):
                if c is None:
                    return base([], "chat.completion.chunk")
                return base(
                    [{"index": i, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}],
                    "chat.completion.chunk",
                )

            return self.stream(request, gen, make_chunk, finish_chunk, include)
        choices = await self.run(request, gen)

        # Detokenising every logprob token and encoding the JSON take long for n = 16 with
        # logprobs: both off the event loop (a JSONResponse is encoded when it is made).
        def reply() -> JSONResponse:
            return JSONResponse(
                {
                    **base(
                        [
                            {
                                "index": i,
                                "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs_of(c),
                                "finish_reason": c.finish_reason,
                            }
                            for i, c in enumerate(choices)
                        ]
                    ),
                    "usage": self.usage(gen, choices),
                }
            )

        return await self.off_loop(request, reply)

    async def reload(self, request: Request):
        """POST /v1/reload {"model_path": FOLDER}: serve another checkpoint from now on.

        The new model is loaded off the event loop (requests keep being served meanwhile), then
        swapped in: requests submitted before the swap finish on the old engine, whose thread
        drains its queue before it stops; later ones go to the new engine. One reload at a time."""
        if self.reloader is None:
            raise OpenAIError(
                404,
                "reloading is off on this server: start swarmrl serve with --reload-token-file",
                kind="not_found_error",
            )
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.reloader.token.encode()):
            raise OpenAIError(
                401,
                "POST /v1/reload needs 'Authorization: Bearer <the --reload-token-file's token>'",
                kind="authentication_error",
                code="invalid_api_key",
            )
        try:
            body = loads(await request.body())
        except BodyError as exc:
            raise OpenAIError(400, f"request body: {exc}") from None
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise OpenAIError(400, 'the body must be {"model_path": "/a/checkpoint/folder"}', "model_path")
        if not Path(path).is_dir():
            raise OpenAIError(400, f"'model_path' {path!r} is not a folder on the server's machine", "model_path")
        async with self.reloading:
            t0 = time.monotonic()
            try:
                engine, context, vocab = await asyncio.to_thread(self.reloader.load, path)
            except Exception as exc:  # noqa: BLE001 - a bad folder is the caller's problem, told without a traceback
                raise OpenAIError(
                    400, f"could not load {path}: {type(exc).__name__}: {str(exc)[:300]}", "model_path"
                ) from None
            old, self.engine, self.tokenizer = self.engine, engine, engine.tokenizer
            self.settings.context, self.settings.vocab_size = context, vocab
            self.settings.model_path = str(Path(path).resolve())
            await asyncio.to_thread(old.close)
        return {
            "success": True,
            "model_path": self.settings.model_path,
            "context": context,
            "seconds": round(time.monotonic() - t0, 3),
        }


def build_app(engine: Engine, settings: Settings, reloader: Reloader | None = None) -> FastAPI:
    app = FastAPI(title="swarmrl serve", docs_url=None, redoc_url=None)
    created = int(time.time())
    error_handlers(app)
    routes = _Routes(engine, settings, reloader)

    @app.get("/v1/models")
    async def models():
        # `root` is the checkpoint folder being served (vLLM's field), so a caller can check a reload.
        # `swarmrl_prompt_format`: the prompts the model was trained on, for this project's policies.
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "swarmrl",
                    "max_model_len": settings.context,
                    "root": settings.model_path,
                    "swarmrl_prompt_format": trained_prompt_format(settings.model_path),
                }
            ],
        }

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/stats")
    async def stats():
        # The engine's counters (generated_tokens, cancelled_waiting, cancelled_running: requests
        # dropped or stopped because their client left), and the completions admitted now.
        return {**routes.engine.stats, "queued_completions": routes.queued.all}

    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/reload")(routes.reload)
    app.post("/tokenize")(routes.tokenize)
    app.state.routes = routes
    return app


def serve(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    device: str = "cpu",
    dtype: str = "float32",
    model_name: str | None = None,
    max_batch_rows: int = 32,
    batch_window_ms: float = 5.0,
    max_n: int = 16,
    max_request_kb: int = 1024,
    default_max_tokens: int = 256,
    url_file: str | None = None,
    threads: int | None = None,
    reload_token_file: str | None = None,
    engine: str = "builtin",
    tls_cert: str | None = None,
    tls_key: str | None = None,
    max_connections: int = 512,
    max_connections_per_source: int = 128,
    header_timeout_s: float = 10.0,
    keep_alive_s: float = 5.0,
    body_timeout_s: float = 30.0,
    max_queued_per_client: int = 256,
    max_queued_total: int = 1024,
    tokenizer_threads: int = 2,
) -> None:
    """Load the checkpoint, start the engine and serve until interrupted. With
    `reload_token_file`, POST /v1/reload (bearer: the file's content) swaps in another folder.
    Connections are bounded per source address (transport/connlimit.py)."""
    import socket

    import torch
    import uvicorn

    from swarmrl.model.checkpoint import load_policy
    from swarmrl.transport.filesystem import atomic_write_text

    if threads:
        torch.set_num_threads(threads)

    from swarmrl.transport.connlimit import SourceSlots, guarded_h11

    if not max_n <= max_queued_per_client <= max_queued_total:
        raise ValueError(
            f"--max-queued-per-client ({max_queued_per_client}) must be between --max-n ({max_n}), so that a "
            f"request of n = {max_n} can run, and --max-queued-total ({max_queued_total})"
        )
    if not 1 <= max_connections_per_source <= max_connections:
        raise ValueError(
            f"--max-connections-per-source ({max_connections_per_source}) must be between 1 and "
            f"--max-connections ({max_connections})"
        )
    engine_kind = engine  # `engine` is rebound to the running Engine below
    if tls_cert or tls_key:
        from swarmrl.protocol.tls import server_context

        if not (tls_cert and tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both")
        server_context(tls_cert, tls_key)  # a clear error before the model loads

    def load(folder: str) -> tuple[Engine, int, int]:
        model, tokenizer = load_policy(folder, device=device, dtype=getattr(torch, dtype))
        model.eval()
        runner = Engine(
            model, tokenizer, max_batch_rows=max_batch_rows, batch_window_s=batch_window_ms / 1000, kind=engine_kind
        )
        return runner, int(getattr(model.config, "max_position_embeddings", 2048)), int(model.config.vocab_size)

    reloader = None
    if reload_token_file is not None:
        reloader = Reloader(load, Path(reload_token_file).read_text().strip())
    engine, context, vocab = load(model_path)
    name = model_name or Path(model_path).resolve().name
    app = build_app(
        engine,
        Settings(
            model_name=name,
            context=context,
            max_n=max_n,
            max_request_bytes=max_request_kb << 10,
            default_max_tokens=default_max_tokens,
            vocab_size=vocab,
            model_path=str(Path(model_path).resolve()),
            body_timeout_s=body_timeout_s,
            max_queued_per_client=max_queued_per_client,
            max_queued_total=max_queued_total,
            tokenizer_threads=tokenizer_threads,
        ),
        reloader,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"{'https' if tls_cert else 'http'}://{host}:{sock.getsockname()[1]}"
    print(
        f"serving {name} ({context}-token context) at {url}/v1"
        + ("; POST /v1/reload swaps the checkpoint" if reloader else ""),
        flush=True,
    )
    fmt = trained_prompt_format(model_path)
    if fmt is not None:
        print(
            f"trained on {fmt['task']} prompts such as {fmt['example']!r}; other prompts get nonsense. "
            f"{fmt['how'][0].upper()}{fmt['how'][1:]}.",
            flush=True,
        )
    if url_file:
        atomic_write_text(Path(url_file), json.dumps({"url": url, "model": name}))
    slots = SourceSlots.sized(max_connections, max_connections_per_source)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        # One source's sockets must not deny service to another's (transport/connlimit.py).
        http=guarded_h11(slots, head_timeout_s=header_timeout_s, idle_timeout_s=keep_alive_s),
        timeout_keep_alive=keep_alive_s,
        limit_concurrency=None,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        app.state.routes.engine.close()
