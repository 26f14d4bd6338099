"""What a run says about itself: the step/epoch records (:mod:`.events`) and the
scheduler-side store that keeps each run's bounded history (:mod:`.metrics`).
"""
