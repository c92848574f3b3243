-- The replication user and a small schema for the compose setup.
\set pw `cat /run/secrets/cdc_password`
CREATE ROLE cdc LOGIN REPLICATION PASSWORD :'pw';
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, created_at timestamptz DEFAULT now());
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint REFERENCES customers (id),
                     amount numeric(12, 2) NOT NULL, status text NOT NULL, updated_at timestamptz DEFAULT now());
GRANT SELECT ON customers, orders TO cdc;
-- cdcd creates the publication when absent; creating it here lets cdc stay a non-owner.
CREATE PUBLICATION cdcd FOR TABLE customers, orders;
