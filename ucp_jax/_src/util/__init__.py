"""Small utilities the layers share: libc calls, GC pauses, cross-process barriers."""
