"""Data: conversation sources, chat templating with assistant-only labels, self-distillation."""
