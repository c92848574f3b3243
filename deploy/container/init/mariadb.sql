-- The replication user and a small schema for the compose setup (password as in the secret).
CREATE USER 'cdc'@'%' IDENTIFIED BY 'change-me';
GRANT SELECT, RELOAD, REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR ON *.* TO 'cdc'@'%';
CREATE TABLE shop.customers (id BIGINT PRIMARY KEY, name VARCHAR(200) NOT NULL, email VARCHAR(200),
                             created_at TIMESTAMP(6) DEFAULT CURRENT_TIMESTAMP(6));
CREATE TABLE shop.orders (id BIGINT PRIMARY KEY, customer_id BIGINT, amount DECIMAL(12, 2) NOT NULL,
                          status VARCHAR(20) NOT NULL, updated_at TIMESTAMP(6) DEFAULT CURRENT_TIMESTAMP(6));
