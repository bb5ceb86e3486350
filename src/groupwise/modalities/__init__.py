"""Non-text policies (flow matching, ...) that implement the trainer's Policy protocol."""
