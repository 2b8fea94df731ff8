"""The PEFT seam: flashdora's DoRA variant, PEFT's layer classes as enable re-classes them, and the switches."""
