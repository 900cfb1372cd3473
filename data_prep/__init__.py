"""Data preparation for mtp-train: sources -> chat-templated rows with assistant-only targets ->
train/validation datasets, self-distilled answers, and the hidden-state cache (`mtp-prep`).

This package may import `mtp_train` (the readers of what it writes live there: `mtp_train.data`);
`mtp_train` never imports it."""
