"""The kept state of the fast paths: one owner per process, one validity rule,
and the kept plans of small collectives."""
