"""The engine's loop in a background thread, and the per-request streams an async server reads.

The LLM is not thread-safe, and its loop must never wait on HTTP. So one thread owns it and
steps it while there is work. The HTTP side (asyncio) hands it requests and cancellations
through a queue, which the thread drains between steps: new requests join the running batch
there. Each request's text travels back through its own asyncio queue, which the engine
thread fills with call_soon_threadsafe as tokens are produced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from llm import LLM, Request

log = logging.getLogger("nanokv.server")


@dataclass
class Event:
    """A piece of a request's output: new text, and on the last event why it ended (or an error)."""

    text: str = ""
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "cancelled"
    error: str | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Stream:
    """One request's events, filled by the engine thread and read by its HTTP handler."""

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop):
        self.req = req
        self.done = False  # the last event has been read
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    def push(self, event: Event) -> None:
        """Called by the engine thread."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def __aiter__(self):
        while not self.done:
            event = await self._events.get()
            self.done = event.last
            yield event


class EngineLoop:
    """Steps an LLM in its own thread for as long as requests are queued or running."""

    def __init__(self, llm: LLM, on_step=None, on_finish=None):
        """on_step(seconds) after every step and on_finish(request) for every request that ends
        (both called in the engine thread): the server's metrics."""
        self.llm = llm
        self.accepting = True  # False once draining for shutdown: new requests are refused
        self._on_step, self._on_finish = on_step, on_finish
        self._inbox: queue.SimpleQueue[tuple[str, Stream]] = queue.SimpleQueue()
        self._streams: dict[int, Stream] = {}
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanokv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> Stream:
        """Queue a request made by LLM.new_request (from the event loop's thread); its text
        arrives on the returned stream."""
        stream = Stream(req, asyncio.get_running_loop())
        req.on_text = lambda _, text: stream.push(Event(text))
        self._idle.clear()
        self._inbox.put(("add", stream))
        return stream

    def cancel(self, stream: Stream) -> None:
        """Stop a request (its client went away); its pages return to the pool before the next step."""
        self._inbox.put(("cancel", stream))

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted to the cache: queued in the engine, or on their way to it."""
        return len(self.llm.waiting) + self._inbox.qsize()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running (True), or the timeout passes (False)."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            self._take_inbox(block=not self.llm.has_work())
            if not self.llm.has_work():
                continue
            t0 = time.perf_counter()
            try:
                finished = self.llm.step()
            except Exception as e:  # a bug or an out-of-memory: fail the requests, keep serving
                log.exception("engine step failed")
                self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
                continue
            if self._on_step:
                self._on_step(time.perf_counter() - t0)
            for req in finished:
                self._finish(req, Event(finish_reason=req.finish_reason))

    def _take_inbox(self, block: bool) -> None:
        """Apply every queued add and cancel; when idle, sleep until one arrives."""
        while True:
            if block and self._inbox.empty():
                self._idle.set()
            try:
                op, stream = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if op == "add":
                self._streams[stream.req.id] = stream
                self.llm.enqueue(stream.req)
            elif stream.req.id in self._streams:
                self.llm.cancel(stream.req)
                self._finish(stream.req, Event(finish_reason="cancelled"))

    def _finish(self, req: Request, event: Event) -> None:
        stream = self._streams.pop(req.id, None)
        if stream is None:  # cancelled earlier: it ends again when the step that retires it reads it
            return
        if self._on_finish:
            self._on_finish(req)
        stream.push(event)

    def _fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            self.llm.cancel(stream.req)
            self._finish(stream.req, Event(error=message))
