-- A relay that has work again withdraws its registration.
--
-- $1 the relay's id.
DELETE FROM idem_outbox_listeners WHERE relay = $1
