fn main() {
    println!("glmflash-node: under construction");
}
