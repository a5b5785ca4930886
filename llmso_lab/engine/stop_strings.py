"""Stop strings (`SamplingParams.stop`): the answer ends before the first one that appears in its text.

Token ids cannot be matched against a string (a stop string may span tokens, or end inside one), so after every
step each running sequence that has stop strings decodes its new tokens (`engine.detokenizer`) and, when one
appears, finishes with reason "stop"; its text is cut before the stop string (vLLM's default), so
`CompletionOutput.text` leaves it out. The blocks go back when the sequence is retired, as for EOS."""
from __future__ import annotations

from llmso_lab.engine.detokenizer import IncrementalDetokenizer
from llmso_lab.engine.sequence import SequenceStatus


class StopStrings:
    name = "stop"

    def __init__(self, engine) -> None:
        self.engine = engine
        self.detok: dict[int, IncrementalDetokenizer] = {}   # seq_id -> its text so far

    def check_request(self, params) -> None:
        if params.stop and self.engine.tokenizer is None:
            raise ValueError("stop strings are matched on the decoded text: give the engine a tokenizer, or use "
                             "stop_token_ids")

    def after_update(self, now: float) -> None:
        for seq in self.engine.scheduler.running:
            stop = seq.sampling_params.stop
            if not stop or seq.output_text is not None:
                continue
            d = self.detok.setdefault(seq.seq_id, IncrementalDetokenizer(self.engine.decode, stop,
                                                                         seq.sampling_params.min_tokens))
            d.add(seq.output_token_ids[len(d.ids):])
            if d.stopped_at is not None:
                seq.output_text, seq.finish_reason, seq.status = d.text, "stop", SequenceStatus.FINISHED

    def on_retire(self, seqs) -> None:
        for seq in seqs:
            self.detok.pop(seq.seq_id, None)

    def stats(self) -> dict:
        return {}
