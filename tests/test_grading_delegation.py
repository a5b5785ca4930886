"""The delegation scan (`llmso_lab.grading.audit`): no callable of the student's library copy answers an exercise.

For every exercise of every lab, every function and class of the library whose signature takes the exercise's
public cases is called on them with the exercise's references and tripwires disabled, as in its grading job.
One that passes every public case would give the student full public marks for a one-line delegation: it must
join that exercise's `tripwires`. The second test is the scan's positive control: with the tripwires of two
exercises lifted, it finds the library twins those tripwires are there for.
"""
import dataclasses

from llmso_lab.grading import exercises, labs
from llmso_lab.grading.audit import candidates, delegation_scan, library_callables
from llmso_lab.grading.registry import get_exercise


def test_no_library_callable_passes_an_exercises_public_cases():
    refs = library_callables()
    assert len(refs) > 300 and "llmso_lab.kv.streaming:streaming_block_keep" in refs
    exs = [ex for lab in labs() for ex in exercises(lab)]
    assert sum(len(candidates(ex, refs)) for ex in exs) > 1000   # the scan calls many, it is not vacuous
    found = delegation_scan(exs, refs)
    assert found == {}, ("these library callables answer an exercise on their own; add them to its spec's "
                         f"`tripwires`: {found}")


def test_the_scan_finds_the_twins_once_their_tripwires_are_lifted():
    lifted = [dataclasses.replace(get_exercise(name), tripwires=()) for name in ("h2o_keep",)]
    found = delegation_scan(lifted)
    assert "llmso_lab.kv.evict:_top_plus_recent" in found.get("lab10/h2o_keep", []), found
