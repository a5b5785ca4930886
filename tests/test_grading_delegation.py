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


def test_what_a_reference_computes_with_is_disabled_with_it():
    """Issue 49, delegation by capability: a submission can compose an answer from the reference's own parts (a
    helper plus one op: the measured-bubble helper, the ring walk, the engine's slot mapping). Every library function
    or class a reference calls is disabled with it, unless it is one of the shared helpers that compute no part of an
    answer (argument checks, ceil division, masks, value classes, kernel plumbing)."""
    from llmso_lab.grading.audit import SHARED_HELPERS, reference_dependencies

    exs = [ex for lab in labs() for ex in exercises(lab)]
    found = {ex.key: deps for ex in exs if (deps := reference_dependencies(ex))}
    assert found == {}, f"disable these with their exercise (its spec's `tripwires`), or add them to SHARED_HELPERS: {found}"
    # the audit is not vacuous: lifting an exercise's tripwires shows what it found before
    lifted = dataclasses.replace(get_exercise("tp_mlp_forward"), tripwires=())
    assert "llmso_lab.parallel.tensor:shard_linear" in reference_dependencies(lifted)
    assert all(":" in h for h in SHARED_HELPERS)


def test_kernels_launched_by_a_disabled_function_are_disabled_too():
    """A Triton kernel launched directly instead of through its disabled wrapper (issue 49): the kernels behind an
    exercise's disabled functions are disabled with them."""
    assert "llmso_lab.attention.triton_mla:_mla_decode_kernel" in get_exercise("mla_decode_absorbed").disabled
    assert "llmso_lab.attention.triton_flash:_flash_fwd_kernel" in get_exercise("flash_attention").disabled
    assert "llmso_lab.quant.triton_w4a16:_w4a16_kernel" in get_exercise("int4_matmul").disabled


def ring_pick_twin(ring, key, loads, c):
    """Lab 04's bounded-load pick written again (the positive control of the mechanism scan below)."""
    import bisect
    import math

    cap = math.ceil(c * (sum(loads) + 1) / len(loads))
    start, seen = bisect.bisect_left([p for p, _ in ring], key), []
    for j in range(len(ring)):
        r = ring[(start + j) % len(ring)][1]
        if r not in seen:
            seen.append(r)
            if loads[r] + 1 <= cap:
                return r
    raise ValueError("every replica is full")


def test_the_scan_runs_a_mechanism_exercises_candidates_through_its_harness():
    """A mechanism exercise's candidates play the student's object inside the harness (as the grader runs it): a
    library twin of the bounded-load pick is found, a function of the same shape that picks otherwise is not."""
    ex = get_exercise("bounded_load_pick")
    twin, other = "test_grading_delegation:ring_pick_twin", "llmso_lab.attention.reference:merge_attention_states"
    assert candidates(ex, [twin, other]) == [twin, other]
    assert delegation_scan([ex], [twin, other]) == {"lab04/bounded_load_pick": [twin]}
