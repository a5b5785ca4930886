"""llmso-lab: labs and a mini serving engine for LLM serving optimization."""
__version__ = "0.1.0"
