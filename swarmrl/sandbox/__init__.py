"""Running untrusted programs: bubblewrap sandboxes in a bounded pool (``runner``), the
per-slot cgroups that bound them (``cgroups``), and the in-sandbox harness (``harness``)."""
