"""The kopf reconciler: handlers (I/O shell) over pure status and drift logic."""
