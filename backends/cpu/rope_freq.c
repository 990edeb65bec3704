/* rope_freq: to be written */
