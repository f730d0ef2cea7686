"""Stage 1, first half: `dflash generate`, the target writes its own training text."""
