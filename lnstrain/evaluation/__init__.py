"""Downstream evaluation: lm-evaluation-harness tasks on lnstrain checkpoints and Hugging Face models."""
