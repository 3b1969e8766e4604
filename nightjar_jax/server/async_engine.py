"""``AsyncEngine``: one engine thread that owns the (not thread-safe) :class:`LLMEngine`, and an asyncio front.

Vocabulary:

- **group**: the engine requests behind one HTTP request (one per prompt × ``n``), added and aborted together.
- **command**: an add / abort / call / stop message from the event loop to the engine thread (a deque under a
  condition).
- **sink**: the group's ``asyncio.Queue`` on the event loop; the engine thread hands it ``(index, RequestOutput)``
  pairs through ``loop.call_soon_threadsafe``, and a final ``None`` when every member has finished.

The engine thread drains commands, runs ``engine.step()`` while anything is unfinished, and otherwise sleeps on the
condition (no busy spin). Only that thread calls into the engine; other threads read a few integer gauges for
``/metrics`` (single attribute reads, safe under the GIL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from nightjar_jax.engine.engine import EngineSleepingError
from nightjar_jax.engine.outputs import CompletionOutput, RequestOutput
from nightjar_jax.engine.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

# stop() waits this long for the engine thread to abort the running requests between two steps, then answers their
# groups itself (a step may be a compile of seconds; the server stops the engine a second before uvicorn's
# --shutdown-timeout cancels the handlers)
STOP_GRACE_S = 0.25


class EngineShuttingDown(RuntimeError):
    """An add or call that came too late: the engine is stopping (the server's 503)."""

    def __init__(self) -> None:
        super().__init__("the engine is shutting down")


@dataclass
class _Group:
    """Engine requests that belong to one HTTP request."""

    request_ids: list[str]  # engine request id per member, member i = index i
    sink: asyncio.Queue  # (index, RequestOutput) items, then None; or an Exception if the add failed
    loop: asyncio.AbstractEventLoop
    num_unfinished: int = 0
    added: bool = False  # every member is in the engine (set by the engine thread)
    base: str | None = None  # the caller's request id, held (AsyncEngine.claim) until every member finished
    last: dict[int, RequestOutput] = field(default_factory=dict)  # per member: its latest output
    # per member, once it is in the engine: (prompt text, prompt ids, asked for logprobs), for a shutdown's answer
    # to a member without an output yet (_close_groups)
    prompts: dict[int, tuple[str | None, list[int], bool]] = field(default_factory=dict)

    def push(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.sink.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    group: _Group
    prompts: list[Any]  # per member: str | list[int]
    params: list[SamplingParams]  # per member
    ack: asyncio.Future  # resolved with None, or the ValueError that rejected the group
    priority: int = 0  # every member's (scheduling_policy "priority")
    bypass_drain: bool = False  # goes ahead of a draining call that waits (a beam search's next step)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]  # called with the engine, on the engine thread, between two steps
    done: asyncio.Future  # resolved with what it returned, or the exception it raised
    # while drain(engine) is true the call waits, and the commands after it with it (aborts and bypass_drain adds
    # excepted), while the engine steps on: what was in flight finishes first
    drain: Callable[[Any], bool] | None = None


@dataclass
class EngineHooks:
    """Callbacks the engine thread runs on each output (the server's metrics)."""

    on_output: list[Callable[[RequestOutput], None]] = field(default_factory=list)


class GroupStream:
    """The outputs of one group, in arrival order; ``abort()`` stops every unfinished member."""

    def __init__(self, engine: AsyncEngine, group: _Group):
        self._engine, self._group = engine, group
        self.finished = False
        self._aborted = False
        self.prompt_tokens: list[int] = []  # per member, when the caller knows them (the server's usage)
        self.prompt_token_ids: list[list[int]] = []  # (and their ids: return_token_ids' first chunk)

    @property
    def request_ids(self) -> list[str]:
        return self._group.request_ids

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while True:
            item = await self._group.sink.get()
            if item is None:
                self.finished = True
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            yield item

    async def next(self, timeout: float | None = None) -> tuple[int, RequestOutput] | None:
        """The next output, ``None`` when the group is done; raises ``TimeoutError`` after ``timeout`` seconds."""
        item = await asyncio.wait_for(self._group.sink.get(), timeout)
        if item is None:
            self.finished = True
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def abort(self) -> None:
        """Abort the unfinished members, once: a second call (the response's own after its generator's) sends
        nothing, so it cannot abort a new request that took a finished one's id in between."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._engine.abort(self._group.request_ids)


class AsyncEngine:
    """Runs ``engine.step()`` in a dedicated thread; ``add`` / ``abort`` are safe to call from the event loop."""

    def __init__(self, engine, hooks: EngineHooks | None = None):
        self.engine = engine
        self.hooks = hooks or EngineHooks()
        self._commands: deque = deque()
        self._cond = threading.Condition()
        self._groups: dict[str, tuple[_Group, int]] = {}  # engine request id -> (group, member index)
        # held while _groups changes: the engine thread delivers, and stop() may close the groups beside it
        self._groups_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.error: BaseException | None = None  # set when the engine thread died
        # callers' request ids in flight (a group's, until every member finished; a beam search's, for its steps):
        # the engine's own check is per member, so one id could serve two requests once a member of the first ended
        self._claimed: set[str] = set()
        self._claim_lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nightjar-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0, grace: float = STOP_GRACE_S) -> None:
        """Abort whatever is still running, then end the engine thread. Adds and calls still queued are answered
        at once ("the engine is shutting down": the server's 503): the engine thread reads its queue only between
        steps, and a long step (a compile) outlasted a short --shutdown-timeout, so their handlers were cancelled
        waiting (bare 500s, cut streams). For the same reason, when the engine thread has not aborted the running
        requests within ``grace`` seconds (a step still runs), their groups are answered from here: each member
        its latest output, finish reason "abort" (:meth:`_close_groups`); the engine aborts them after the step."""
        in_flight = self.num_active_groups
        with self._cond:
            first, self._stopping = not self._stopping, True
            queued = [c for c in self._commands if isinstance(c, (_Add, _Call))]
            for command in queued:
                self._commands.remove(command)
            self._cond.notify()
        if first:  # (logged here, where they are aborted: the server's shutdown stops the engine before the end of
            # --shutdown-timeout, and a count taken after that said 0)
            logger.log(logging.WARNING if in_flight else logging.INFO,
                       "shutting down: aborting %d in-flight request(s)", in_flight)
        for command in queued:
            if isinstance(command, _Add):
                self._resolve(command.ack, EngineShuttingDown())
            else:
                self._settle(command.done, None, EngineShuttingDown())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(min(timeout, grace))
            if self._thread.is_alive():
                self._close_groups()
                self._thread.join(max(0.0, timeout - grace))

    def _close_groups(self) -> None:
        """Answer every running group now, without the engine (its thread is in a step): each unfinished member's
        latest output again as finished with reason "abort" (no output yet: an empty one). Outputs the engine gives
        them later are dropped (:meth:`_deliver` finds no group); the engine thread aborts them as it stops."""
        with self._groups_lock:
            entries = list(self._groups.items())
            self._groups.clear()
        for rid, (group, index) in entries:
            last = group.last.get(index)
            if last is None:  # (its prompt, and the log-probabilities it asked for: none yet)
                text, ids, logprobs = group.prompts.get(index, (None, [], False))
                out = RequestOutput(rid, text, ids, [CompletionOutput(0, "", [], finish_reason="abort",
                                                                      logprobs=[] if logprobs else None)], True)
            else:
                out = dataclasses.replace(last, finished=True, outputs=[dataclasses.replace(
                    last.outputs[0], finish_reason="abort", stop_reason=None, delta_text="", delta_token_ids=[])])
            self._run_hooks(out)
            group.push((index, out))
            group.num_unfinished -= 1
            if group.num_unfinished == 0:
                self.release(group.base)
                group.push(None)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_active_groups(self) -> int:
        return len({id(g) for g, _ in list(self._groups.values())})

    # ---- request ids --------------------------------------------------------------------------------------------
    def claim(self, request_id: str) -> None:
        """Hold a caller's request id while its request is in flight; one already held is an
        ``InvalidRequestError`` (field ``request_id``)."""
        with self._claim_lock:
            if request_id in self._claimed:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._claimed.add(request_id)

    def _claim_automatic_id(self) -> str:
        """A group's own id ("req-N") for a caller that gave none (a beam search's steps), held like a caller's: an
        id a caller holds is skipped (a Responses request_id "req-0" made a beam search's "req-0-0" a duplicate), and
        a caller cannot take one in flight."""
        with self._claim_lock:
            while (base := f"req-{next(self._ids)}") in self._claimed:
                pass
            self._claimed.add(base)
        return base

    def release(self, request_id: str | None) -> None:
        if request_id is not None:
            with self._claim_lock:
                self._claimed.discard(request_id)

    # ---- event-loop side ----------------------------------------------------------------------------------------
    async def add(self, prompts: list[Any], params: list[SamplingParams], request_id: str | None = None,
                  priority: int = 0, bypass_drain: bool = False) -> GroupStream:
        """Queue one group (member i = ``prompts[i]`` with ``params[i]``, all at ``priority``); raises ValueError if
        any member is bad (then nothing is queued). ``bypass_drain``: it goes ahead of a draining :meth:`call` that
        waits (the next step of work that call waits for)."""
        if self._stopping or not self.is_alive:
            raise EngineShuttingDown()
        loop = asyncio.get_running_loop()
        if request_id is not None:
            self.claim(request_id)
            base = request_id
        else:
            base = self._claim_automatic_id()
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        group = _Group(ids, asyncio.Queue(), loop, num_unfinished=len(ids), base=base)
        ack = loop.create_future()
        self._send(_Add(group, prompts, params, ack, priority, bypass_drain))
        try:
            await ack
        except BaseException:
            if not group.added:  # (nothing was queued; a group queued before a cancellation holds it until it ends)
                self.release(base)
            raise
        return GroupStream(self, group)

    def abort(self, request_ids: list[str]) -> None:
        self._send(_Abort(list(request_ids)))

    def abort_all(self) -> int:
        """Abort every request queued or running (their streams end with finish reason "abort"); returns how many
        were (commands sent after this one, e.g. a weight update's, find them gone)."""
        with self._groups_lock:
            ids = list(self._groups)
        self.abort(ids)
        return len(ids)

    async def call(self, fn: Callable[[Any], Any], drain: Callable[[Any], bool] | None = None) -> Any:
        """``fn(engine)`` on the engine thread between two steps (the engine is not thread-safe), e.g. sleep and
        wake_up; returns what it returned, or raises what it raised. With ``drain``, it runs once ``drain(engine)``
        is false (e.g. nothing in flight), the engine stepping meanwhile, and commands sent after it wait behind it
        (new requests are admitted after it: a weight update between two policies' samples)."""
        if self._stopping or not self.is_alive:
            raise EngineShuttingDown()
        done = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, done, drain))
        return await done

    def _send(self, command: Any) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- engine thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        held: list = []  # a draining call that waits, and the commands behind it
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                        if held:  # (idle: look at the drain condition again soon; it may depend on the event loop)
                            self._cond.wait(0.01)
                            break
                        self._cond.wait()
                    commands = held + list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                held = []
                for command in commands:
                    if held:  # behind a waiting drain: only aborts and bypassing adds go ahead
                        if isinstance(command, _Abort) or (isinstance(command, _Add) and command.bypass_drain):
                            self._handle(command)
                        else:
                            held.append(command)
                    elif isinstance(command, _Call) and command.drain is not None and not stopping and \
                            command.drain(engine):
                        held.append(command)
                    else:
                        self._handle(command)
                if stopping:
                    for command in held:  # (never run: the engine stops)
                        self._handle(command)
                    self._abort_all()
                    for rid in list(engine.requests):  # (those whose groups stop() answered: their pages back)
                        engine.abort_request(rid)
                    self._close_engine()
                    return
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as exc:  # a bug or device error: fail the in-flight requests, keep serving
                        logger.exception("engine step failed; aborting %d request(s)", len(self._groups))
                        self._abort_all(error=exc)
                        continue
                    for out in outputs:
                        self._deliver(out)
        except BaseException as exc:  # pragma: no cover - last resort, keeps waiting clients from hanging
            self.error = exc
            logger.exception("engine thread died")
            self._abort_all(error=exc)
            self._close_engine()

    def _close_engine(self) -> None:
        """The engine's shutdown (its planner's decision log written out), on the engine thread as it ends."""
        try:
            self.engine.close()
        except Exception:  # pragma: no cover - the log's disk failing must not hide the shutdown
            logger.exception("closing the engine failed")

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Call):
            if self._stopping:
                self._settle(command.done, None, EngineShuttingDown())
                return
            try:
                result = command.fn(self.engine)
            except Exception as exc:
                self._settle(command.done, None, exc)
            else:
                self._settle(command.done, result, None)
            return
        if isinstance(command, _Abort):
            for rid in command.request_ids:
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._deliver(out)
            return
        group = command.group
        if self._stopping:
            self._resolve(command.ack, EngineShuttingDown())
            return
        added: list[str] = []
        try:
            for i, (rid, prompt, sp) in enumerate(zip(group.request_ids, command.prompts, command.params, strict=True)):
                self.engine.add_request(prompt, sp, request_id=rid, priority=command.priority)
                added.append(rid)
                queued = self.engine.requests[rid]
                group.prompts[i] = (queued.prompt, list(queued.prompt_token_ids), sp.logprobs is not None)
                with self._groups_lock:
                    self._groups[rid] = (group, i)
        except Exception as exc:  # ValueError: bad input; anything else (e.g. the tokenizer choking) is one too
            for rid in added:
                self.engine.abort_request(rid)
                with self._groups_lock:
                    self._groups.pop(rid, None)
            if not isinstance(exc, (ValueError, EngineSleepingError)):  # (asleep: the server answers 503)
                logger.warning("add_request failed: %r", exc)
                exc = ValueError(f"the prompt could not be processed: {exc}")
            self._resolve(command.ack, exc)
            return
        group.added = True
        self._resolve(command.ack, None)

    @classmethod
    def _resolve(cls, ack: asyncio.Future, exc: BaseException | None) -> None:
        cls._settle(ack, None, exc)

    @staticmethod
    def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
        """Resolve ``future`` (on its event loop) with ``result``, or with ``exc`` when it is not None."""
        def settle() -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(result)
            else:
                future.set_exception(exc)

        try:
            future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def _deliver(self, out: RequestOutput) -> None:
        if out.request_id not in self._groups:
            return
        self._run_hooks(out)  # (before the consumer sees it: a response received is counted)
        with self._groups_lock:  # (stop() may have answered the group meanwhile: _close_groups)
            entry = self._groups.get(out.request_id)
            if entry is None:
                return
            if out.finished:
                del self._groups[out.request_id]
            group, index = entry
            group.last[index] = out
            group.push((index, out))
            if out.finished:
                group.num_unfinished -= 1
                if group.num_unfinished == 0:
                    self.release(group.base)
                    group.push(None)

    def _run_hooks(self, out: RequestOutput) -> None:
        for hook in self.hooks.on_output:
            try:
                hook(out)
            except Exception:  # metrics must never break serving
                logger.exception("output hook failed")

    def _abort_all(self, error: BaseException | None = None) -> None:
        for rid in list(self._groups):
            try:
                out = self.engine.abort_request(rid)
            except Exception:  # pragma: no cover
                out = None
                logger.exception("abort of %s failed", rid)
            if out is not None:
                if error is not None:
                    out.outputs[0].finish_reason = "error"
                    out.error = str(error)
                self._deliver(out)
            else:  # already gone from the engine: close the member by hand
                with self._groups_lock:
                    entry = self._groups.pop(rid, None)
                    if entry is not None:
                        group = entry[0]
                        group.num_unfinished -= 1
                        if group.num_unfinished == 0:
                            self.release(group.base)
                            group.push(None)
