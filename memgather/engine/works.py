"""The work object of a rewired asynchronous call: torch's, answering as torch's list call does.

A rewired call is carried out by the single-tensor all-gather, whose work object
answers ``result()`` and ``get_future()`` with its own output: one flat tensor,
or tensors of its own over the same memory. torch's list call answers with the
caller's slots themselves, and a program may hold on to that: identity
(``work.result()[i] is out[i]``), and the version counter a write through the
result steps. ``SlotsWork`` wraps the single call's work and answers with the
slots; everything else is torch's work's own answer.

The slots as torch's list call passes them to the backend, that is: a complex
slot as its ``torch.view_as_real`` view, made at the call, as torch makes it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Union, cast

import torch
import torch.distributed as dist


class SlotsWork(dist.Work):
    """torch's work for a rewired call, whose ``result()`` and future's value are the caller's slots."""

    def __init__(self, inner: Any, tensor_list: List[torch.Tensor]) -> None:
        super().__init__()
        self._inner = inner
        self._slots = tensor_list
        self._outputs = [torch.view_as_real(t) if t.is_complex() else t for t in tensor_list]

    def _completed(self) -> None:
        """Called once the single call is known to be done; a subclass completes the gather here."""

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        # timedelta(0) is torch's "no timeout of the call's own" (the group's applies)
        result = self._inner.wait() if timeout == timedelta(0) else self._inner.wait(timeout)
        self._completed()
        return bool(result) if isinstance(result, bool) else True

    def is_completed(self) -> bool:
        if not self._inner.is_completed():
            return False
        self._completed()
        return True

    def get_future(self) -> Any:
        # A future of its own, completed from the single call's: ``then()`` would wrap a failed
        # gather's error in its own message, where torch's future raises the error itself.
        # add_done_callback orders the current streams after the work's, as then() does.
        inner = self._inner.get_future()
        devices: List[Union[int, str, torch.device]] = sorted(
            {t.device for t in self._outputs if t.device.type != "cpu"}, key=str
        )
        future: torch.futures.Future[List[torch.Tensor]] = torch.futures.Future(devices=devices or None)

        def completed(done: Any) -> None:
            try:
                done.value()
            except Exception as error:  # noqa: BLE001 - the gather's own error, handed on as it is
                future.set_exception(cast(Any, error))  # (torch's stubs type it as the result's type)
                return
            self._completed()
            future.set_result(list(self._outputs))

        inner.add_done_callback(completed)
        return future

    def result(self) -> List[torch.Tensor]:
        self._inner.result()  # torch's own refusal before the work completed (and its notice)
        if self._inner.exception() is None:  # a failed gather completes nothing
            self._completed()
        return list(self._outputs)

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def synchronize(self) -> None:
        self._inner.synchronize()
        self._completed()

    def block_current_stream(self) -> None:
        self._inner.block_current_stream()
        self._completed()

    def get_future_result(self) -> Any:
        return self._inner.get_future_result()

    def _get_duration(self) -> float:
        return float(self._inner._get_duration())

    def _get_op_type(self) -> Any:
        return self._inner._get_op_type()
