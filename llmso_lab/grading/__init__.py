"""Lab toolchain: exercise registry, in-notebook `check()`, sandboxed grader, student release."""
from llmso_lab.grading.check import CheckResult, check, student_or_library
from llmso_lab.grading.registry import Case, Exercise, exercises, get_exercise, labs

__all__ = ["Case", "CheckResult", "Exercise", "check", "student_or_library", "exercises", "get_exercise", "labs"]
