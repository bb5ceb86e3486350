"""groupwise: GRPO and its published variants as composable components of one trainer."""

__version__ = "0.1.0"
