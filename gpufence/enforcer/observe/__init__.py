"""Observe: what one poll sees. NVML's GPU processes, /proc's facts about them, and which container
and which pod they belong to; no decisions, no actions."""
