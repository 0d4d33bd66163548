local function is_terminal(s) return s == 'finished' or s == 'failed' or s == 'cancelled' end
