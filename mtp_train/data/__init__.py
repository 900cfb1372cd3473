"""Readers of what data_prep/ writes: conversation sources, chat templating with assistant-only
targets, the hidden-state cache, and CLP's acceptance labels."""
