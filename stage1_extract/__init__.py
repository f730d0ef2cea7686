"""Stage 1: run the target once over a dataset and store what the drafter needs (`dflash extract`)."""
