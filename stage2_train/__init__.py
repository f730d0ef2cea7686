"""Stage 2: train the DFlash drafter from the extracted shards alone (`dflash train`)."""
